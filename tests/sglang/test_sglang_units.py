"""pploader.integrations.sglang without an engine: the plugin's format name, SGLang's own
split, the written-parameter tracking. Marked ``sglang`` (needs sglang importable; see
.ci/sglang-suite.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine_suite import engine_marks

pytestmark = engine_marks("sglang", slow=False)


def test_plugin_makes_the_name_a_choice_and_resolves_it_to_the_class() -> None:
    """After ``register`` and SGLang's ``apply_hooks`` (what ``load_plugins`` runs in every
    process), ``pploader`` is an accepted ``--load-format`` and ``LoadConfig`` turns it into
    the loader class, which ``get_model_loader`` instantiates; other names are untouched."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader
    from sglang.srt.plugins.hook_registry import HookRegistry

    from pploader.integrations.sglang import PPLoaderModelLoader, register
    register()
    HookRegistry.apply_hooks()
    assert "pploader" in LOAD_FORMAT_CHOICES
    config = LoadConfig(load_format="pploader",
                        model_loader_extra_config={"io_backend": "threaded"})
    assert config.load_format is PPLoaderModelLoader
    loader = get_model_loader(config)
    assert isinstance(loader, PPLoaderModelLoader) and isinstance(loader, DefaultModelLoader)
    assert loader.io_backend == "threaded"
    assert LoadConfig(load_format="auto").load_format == LoadFormat.AUTO
    with pytest.raises(ValueError, match="unknown pploader model_loader_extra_config keys"):
        get_model_loader(LoadConfig(load_format="pploader",
                                    model_loader_extra_config={"tp_mod": "full"}))


def test_engine_partition_is_sglangs_get_pp_indices_and_reads_the_env(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.distributed.utils import get_pp_indices

    from engine_suite import check_partition
    from pploader.integrations.sglang import engine_partition
    from pploader.planning.partition import engine_layer_counts
    check_partition(engine_partition, get_pp_indices, "SGLANG_PP_LAYER_PARTITION", monkeypatch)
    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    for layers in range(4, 40):
        for pp in range(1, 5):
            assert list(engine_partition(layers, pp)) == \
                engine_layer_counts("sglang", layers, pp)


def test_sglangs_parameter_classes_are_tracked_then_restored() -> None:
    """SGLang's parameter classes hold ``weight_loader`` as a read-only property: the load
    through it is recorded and the property's slot is put back (tests/integrations/
    test_written.py covers the rest without SGLang)."""
    from sglang.srt.layers.parameter import ModelWeightParameter
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    from pploader.integrations.written import tracking_writes

    def own(param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    model = nn.Module()
    model.c = ModelWeightParameter(data=torch.zeros(2, 2), input_dim=1, output_dim=0,
                                   weight_loader=own)
    with tracking_writes(model, default_weight_loader) as written:
        model.c.weight_loader(model.c, torch.ones(2, 2))
    assert written == {"c"} and bool((model.c == 1).all())
    assert model.c.weight_loader is own


def test_only_a_checkpoint_with_mtp_layers_gets_the_stage_only_draft_load(
        tmp_path: Path) -> None:
    """The draft worker plans an MTP layer only where the draft's checkpoint declares MTP
    layers (a NextN draft of the target's own checkpoint); a draft checkpoint of its own
    (EAGLE) or a hub id goes to SGLang's default loader, as before."""
    from helpers import CONFIGS, make_model, tiny_config

    from pploader.integrations.sglang import _mtp_checkpoint
    import json
    raw = json.loads((CONFIGS / "tiny-deepseek_v3.json").read_text())
    raw.pop("pploader_tiny")
    assert _mtp_checkpoint(str(make_model(tmp_path / "ds", raw, shard_bytes=150_000)))
    assert not _mtp_checkpoint(str(make_model(tmp_path / "llama", tiny_config())))
    assert not _mtp_checkpoint("some-org/some-eagle-draft")
    (tmp_path / "broken").mkdir()
    assert not _mtp_checkpoint(str(tmp_path / "broken"))
