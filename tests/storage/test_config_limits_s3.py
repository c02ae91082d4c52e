"""The config.json limits hold for every storage (issue 44): each hostile config fails on
``s3://`` (a real S3-compatible server, moto) exactly as it fails locally: the same error
type and message, no RecursionError, nothing over the size limit fetched or parsed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from s3_helpers import upload
from pploader import Topology, plan_stage
from pploader.errors import ConfigError, PPLoaderError
from pploader.planning.config_limits import MAX_CONFIG_BYTES
from pploader.testing.s3server import S3Server


def _config(tiny: Path) -> dict:
    return json.loads((tiny / "config.json").read_text())


def _text(cfg: dict, **changes: object) -> str:
    return json.dumps({**cfg, **changes})


#: name -> (config.json text from the good config, a phrase of the one error)
def _hostile(cfg: dict) -> dict[str, tuple[str, str]]:
    good = json.dumps(cfg)
    return {
        "deep_100k": ("[" * 100_000 + "]" * 100_000, "levels deep"),
        "over_16_mib": (good[:-1] + ', "pad": "' + "x" * (MAX_CONFIG_BYTES + 1) + '"}',
                        "over the 16 MiB limit"),
        "layers_1e9": (_text(cfg, num_hidden_layers=10**9), "num_hidden_layers"),
        "nan_eps": (_text(cfg, rms_norm_eps=float("nan")), "rms_norm_eps is nan"),  # NaN
        "inf_eps": (_text(cfg, rms_norm_eps=12345.5).replace("12345.5", "1e999"),
                    "rms_norm_eps is inf"),
        "inf_nested": (_text(cfg, rope_scaling={"factors": [1.0, float("inf")]}),
                       "rope_scaling.factors[1] is inf"),
        "duplicate_layers": (good[:-1] + f', "num_hidden_layers": {cfg["num_hidden_layers"]}}}',
                             "key 'num_hidden_layers' appears twice"),
        "tie_as_string": (_text(cfg, tie_word_embeddings="false"),
                          "tie_word_embeddings is 'false', not true / false"),
        "quant_as_string": (_text(cfg, quantization_config="fp8"),
                            "quantization_config is 'fp8', not an object"),
        "not_json": ("{", "not valid JSON"),
    }


def _error(model: "Path | str") -> PPLoaderError:
    with pytest.raises(PPLoaderError) as exc:
        plan_stage(model, Topology.for_world(1, 0, pp=1))
    return exc.value


def test_hostile_configs_fail_the_same_on_s3_as_locally(s3: S3Server, tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    cases = _hostile(_config(tiny_llama))
    for name, (text, phrase) in cases.items():
        local = tmp_path / name
        shutil.copytree(tiny_llama, local)
        (local / "config.json").write_text(text)
        remote = upload(s3, local, prefix=f"hostile/{name}")
        errors = [_error(local), _error(remote)]
        for where, err in zip(("local", "s3"), errors):
            assert isinstance(err, ConfigError), (name, where, repr(err))
            assert phrase in err.detail, (name, where, err.detail)
        # the same message but for where the file lives
        assert errors[0].detail.replace(str(local / "config.json"), "") == \
            errors[1].detail.replace(f"{remote}/config.json", ""), name
