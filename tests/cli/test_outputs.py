"""Never touch what pploader did not create (issue 43 item 1, issue 40 item 3): every output
(make-tiny, convert, --save-loaded, bench --dir, the demo's OUT) goes only into a new or empty
directory or one pploader marked as its own; --force replaces only pploader's files; outputs
inside the model, URLs and empty paths are refused with exit 2 and nothing written; a failed
job leaves no partial file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import pploader_cmd, run, torchrun_cmd

from pploader import outputs
from pploader.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): 'untouched' means equal."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture()
def user_dir(tmp_path: Path) -> Path:
    """A directory of the user's own files, one named like a checkpoint file."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text('{"mine": true}')
    (d / "notes.txt").write_text("do not lose me")
    (d / "sub").mkdir()
    (d / "sub" / "model.safetensors").write_bytes(b"not yours")
    return d


# ---- make-tiny -----------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [[], ["--force"]])
def test_make_tiny_empty_out_is_refused_and_the_cwd_untouched(user_dir: Path,
                                                              extra: list[str]) -> None:
    before = _tree(user_dir)
    out = run(pploader_cmd("make-tiny", "llama", "", *extra), cwd=user_dir)
    assert out.returncode == 2, out.stderr
    assert "empty" in _one_line(out.stderr)
    assert _tree(user_dir) == before and sorted(os.listdir(user_dir)) == [
        "config.json", "notes.txt", "sub"]


def test_make_tiny_force_never_touches_a_users_directory(user_dir: Path) -> None:
    before = _tree(user_dir)
    for extra in ([], ["--force"]):
        out = run(pploader_cmd("make-tiny", "llama", str(user_dir), *extra))
        assert out.returncode == 2, out.stderr
        line = _one_line(out.stderr)
        assert "not written by pploader" in line and str(user_dir) in line
        assert _tree(user_dir) == before


def test_force_replaces_only_the_files_pploader_listed(tmp_path: Path) -> None:
    out = tmp_path / "t"
    assert run(pploader_cmd("make-tiny", "deepseek_v3", str(out))).returncode == 0
    marker = json.loads((out / outputs.MARKER).read_text())
    assert marker["by"] == "pploader" and marker["command"] == "make-tiny"
    assert set(marker["files"]) == {p.name for p in out.iterdir()} - {outputs.MARKER}
    (out / "README.md").write_text("mine")
    (out / "extra.safetensors").write_bytes(b"mine too")  # a checkpoint-like name, not ours
    proc = run(pploader_cmd("make-tiny", "llama", str(out), "--force", "--shard-bytes", "1G"))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        outputs.MARKER, "README.md", "config.json", "extra.safetensors", "model.safetensors"]
    assert (out / "extra.safetensors").read_bytes() == b"mine too"
    assert json.loads((out / outputs.MARKER).read_text())["files"] == [
        "config.json", "model.safetensors"]


def test_url_outputs_refused_and_no_local_folder(tmp_path: Path) -> None:
    model = tmp_path / "m"
    assert run(pploader_cmd("make-tiny", "llama", str(model))).returncode == 0
    work = tmp_path / "cwd"
    work.mkdir()
    url = "s3://bucket/out"
    cases = [["make-tiny", "llama", u, "--force"] for u in (
        url, "S3://bucket/tiny", "s3:/bucket/x", "file:///tmp/x")] + [
        ["convert", str(model), url, "--allow-pickle"],
        ["load", "--model", str(model), "--pp", "1", "--save-loaded", url],
        ["bench", "--dir", url, "--size-gb", "0.01", "--layers", "2", "--pp", "2"]]
    for argv in cases:
        out = run(pploader_cmd(*argv), cwd=work)
        assert out.returncode == 2, (argv, out.stderr)
        line = _one_line(out.stderr)
        assert "not to a URL" in line and any(a in line for a in argv if ":/" in a), line
        assert list(work.iterdir()) == [], (argv, list(work.iterdir()))


# ---- --save-loaded -------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["model", "model/sub", "model/sub/deeper", "link"])
def test_save_loaded_into_the_model_refused(tmp_path: Path, where: str) -> None:
    model = tmp_path / "model"
    assert run(pploader_cmd("make-tiny", "llama", str(model))).returncode == 0
    (tmp_path / "link").symlink_to(model)  # the model under another name
    before = _tree(model)
    out = run(pploader_cmd("load", "--model", str(model), "--pp", "1", "--save-loaded",
                           str(tmp_path / where)))
    assert out.returncode == 2, out.stderr
    assert "model directory" in _one_line(out.stderr)
    assert _tree(model) == before and sorted(os.listdir(tmp_path)) == ["link", "model"]


def test_save_loaded_refuses_a_users_directory_and_an_empty_path(tmp_path: Path,
                                                                  user_dir: Path) -> None:
    model = tmp_path / "model"
    assert run(pploader_cmd("make-tiny", "llama", str(model))).returncode == 0
    before = _tree(user_dir)
    for target, needle in ((str(user_dir), "not written by pploader"), ("", "empty")):
        out = run(pploader_cmd("load", "--model", str(model), "--pp", "1", "--save-loaded",
                               target), cwd=user_dir)
        assert out.returncode == 2, out.stderr
        assert needle in _one_line(out.stderr)
        assert _tree(user_dir) == before


@pytest.mark.slow
def test_failed_save_loaded_job_leaves_no_rank_file(tiny_llama: Path, tmp_path: Path) -> None:
    """A 2-rank PP=2 load where rank 1 fails after rank 0 wrote its tensors: nothing is
    published (a new DIR is not left behind); an earlier complete output stays as it was."""
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    ok = run(torchrun_cmd(2, "load", "--model", str(tiny_llama), "--pp", "2", "--no-pools",
                          "--save-loaded", str(earlier)), timeout=240)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert sorted(os.listdir(earlier)) == [outputs.MARKER, "rank-0.safetensors",
                                           "rank-1.safetensors"]
    before = _tree(earlier)
    for target in (fresh, earlier):
        out = run(torchrun_cmd(2, "load", "--model", str(tiny_llama), "--pp", "2",
                               "--no-pools", "--save-loaded", str(target)), timeout=240,
                  env={"PPLOADER_FAULT": "rank=1:raise"})
        assert out.returncode != 0, out.stderr[-3000:]
        assert "injected" in out.stderr or "fault" in out.stderr.lower(), out.stderr[-3000:]
    assert not fresh.exists(), list(fresh.iterdir())
    assert _tree(earlier) == before  # no temporary, no half of a new output
    assert sorted(os.listdir(tmp_path)) == ["earlier"]


# ---- convert, bench --dir ------------------------------------------------------------------

def _pickle_model(folder: Path) -> Path:
    import torch
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    return folder


def test_convert_refuses_a_users_directory_and_the_source(tmp_path: Path,
                                                          user_dir: Path) -> None:
    src = _pickle_model(tmp_path / "src")
    before, src_before = _tree(user_dir), _tree(src)
    for dst, needle in ((user_dir, "not written by pploader"), (src, "model directory"),
                        (src / "out", "inside the model directory")):
        out = run(pploader_cmd("convert", str(src), str(dst), "--allow-pickle"))
        assert out.returncode == 2, out.stderr
        assert needle in _one_line(out.stderr)
    assert _tree(user_dir) == before and _tree(src) == src_before
    good = run(pploader_cmd("convert", str(src), str(tmp_path / "dst"), "--allow-pickle"))
    assert good.returncode == 0, good.stderr
    assert sorted(os.listdir(tmp_path / "dst")) == [outputs.MARKER, "model.safetensors"]
    again = run(pploader_cmd("convert", str(src), str(tmp_path / "dst"), "--allow-pickle"))
    assert again.returncode == 2 and "earlier pploader output" in _one_line(again.stderr)


def test_bench_dir_refuses_a_users_directory(tmp_path: Path) -> None:
    """bench deletes its checkpoints at the end: a --dir holding a user's directory of the
    same name as one it writes is refused before anything is written."""
    mine = tmp_path / "ck"
    (mine / "llama-0.01GB-4L-3s").mkdir(parents=True)
    (mine / "llama-0.01GB-4L-3s" / "keep.txt").write_text("mine")
    before = _tree(mine)
    out = run(pploader_cmd("bench", "--size-gb", "0.01", "--layers", "4", "--shards", "3",
                           "--dir", str(mine), "--quiet"))
    assert out.returncode == 2, out.stderr
    assert "not written by pploader" in _one_line(out.stderr)
    assert _tree(mine) == before


def test_gpu_bench_ckdir_refuses_a_users_directory(user_dir: Path, tmp_path: Path) -> None:
    """`pploader bench --device cuda -- --ckdir DIR` rewrites its checkpoint there: never in a
    directory of the user's (it used to delete every *.safetensors in it)."""
    from pploader.bench.cuda import write_checkpoint
    (user_dir / "model.safetensors").write_bytes(b"the user's model")
    before = _tree(user_dir)
    with pytest.raises(UsageError, match="not written by pploader"):
        write_checkpoint(str(user_dir), "tiny")
    assert _tree(user_dir) == before
    ck = tmp_path / "ck"
    write_checkpoint(str(ck), "tiny")
    listed = json.loads((ck / outputs.MARKER).read_text())["files"]
    assert set(listed) == {p.name for p in ck.iterdir()} - {outputs.MARKER}


# ---- the demo ------------------------------------------------------------------------------

def _fake_venv(tmp_path: Path) -> Path:
    """A venv for launch/_venv.sh that installs nothing: this interpreter, `pploader` and
    `torchrun` that run this tree, `activate` (PATH, as a venv's does), and the install stamp
    (newer than setup.cfg)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    for name, module in (("pploader", "pploader"), ("torchrun", "torch.distributed.run")):
        tool = venv / "bin" / name
        tool.write_text(f'#!/bin/sh\nPYTHONPATH="{ROOT}" exec "{sys.executable}" -m {module} '
                        '"$@"\n')
        tool.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    stamp = venv / ".pploader-installed-base"
    stamp.touch()
    future = (ROOT / "setup.cfg").stat().st_mtime + 3600
    os.utime(stamp, (future, future))
    return venv


def test_demo_script_never_deletes_a_users_out(tmp_path: Path, user_dir: Path) -> None:
    """The real launch/demo.sh with OUT set to a user's directory: refused (exit 2), every
    file there survives, nothing else runs."""
    before = _tree(user_dir)
    out = run(["bash", str(ROOT / "launch" / "demo.sh")], timeout=120,
              env={"OUT": str(user_dir), "PPLOADER_VENV": str(_fake_venv(tmp_path)),
                   "MODEL": "configs/models/tiny-llama.json"})
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "not written by pploader" in out.stderr and "OUT=" in out.stderr
    assert "== plan" not in out.stdout and "torchrun" not in out.stdout
    assert _tree(user_dir) == before


@pytest.mark.slow
def test_readme_next_step_after_the_demo_works(tmp_path: Path) -> None:
    """The demo (2 ranks), then the README's next lines as written (activate .venv, `pploader
    plan` on the demo's model) in a shell whose PATH has no pploader: the plan prints. A
    second demo run replaces its own model (no `rm`, no refusal)."""
    venv = _fake_venv(tmp_path)
    out = tmp_path / "demo"
    env = {"OUT": str(out), "PPLOADER_VENV": str(venv), "NPROC": "2",
           "MODEL": "configs/models/tiny-llama.json"}
    for _ in range(2):
        demo = run(["bash", str(ROOT / "launch" / "demo.sh")], timeout=400,
                   env=env)
        assert demo.returncode == 0, (demo.stdout[-2000:], demo.stderr[-3000:])
        assert "pploader plan --model" in demo.stdout.splitlines()[-1]
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Next, activate it", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    steps = [ln.split("#")[0].strip() for ln in block.splitlines() if ln.strip()]
    assert steps[0] == "source .venv/bin/activate" and steps[1].startswith("pploader plan ")
    model = steps[1].split("--model ", 1)[1].split()[0]
    assert model == "out/demo/tiny-qwen3_5_moe"  # demo.sh's default OUT for its default MODEL
    script = "\n".join([steps[0].replace(".venv", str(venv)),
                        steps[1].replace(model, str(out))])
    proc = subprocess.run(["bash", "-c", "set -e\n" + script], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank" in proc.stdout and "layers" in proc.stdout, proc.stdout[-2000:]


def test_launch_scripts_delete_no_directory() -> None:
    """No recursive delete in launch/: outputs are pploader's to replace (pploader.outputs);
    the node-local copy removes only the files it listed."""
    for script in sorted((ROOT / "launch").glob("*.sh")) + sorted(
            (ROOT / "launch").glob("*.sbatch")):
        for n, line in enumerate(script.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not any(f" {bad} " in f" {code} " for bad in ("rm -rf", "rm -r", "rm -fr")) \
                and "rmtree" not in code, f"{script.name}:{n}"


# ---- the module ----------------------------------------------------------------------------

def test_staged_output_failure_leaves_nothing(tmp_path: Path) -> None:
    target = outputs.claim_output(tmp_path / "a" / "b" / "out", "OUT", command="test")
    with pytest.raises(RuntimeError):
        with outputs.staged_output(target) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x" * 100)
            assert outputs.pending() == (tmp,)
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == [] and outputs.pending() == ()


def test_discard_pending_removes_temporaries_in_progress(tmp_path: Path) -> None:
    """What the signal watcher calls before exiting: the temporary output is gone, with the
    parent directory made for it."""
    target = outputs.claim_output(tmp_path / "a" / "out", "OUT", command="test")
    staged = outputs.staged_output(target)
    tmp = staged.__enter__()
    (tmp / "part.safetensors").write_bytes(b"x")
    outputs.discard_pending()
    assert list(tmp_path.iterdir()) == [] and outputs.pending() == ()
    with pytest.raises(FileNotFoundError):
        staged.__exit__(None, None, None)  # the writer finds its directory gone


def test_marker_must_be_pploaders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "data.bin").write_bytes(b"x")
    for marker in ("not json", json.dumps({"files": ["data.bin"]}),
                   json.dumps({"by": "pploader", "files": ["../escape"]})):
        (out / outputs.MARKER).write_text(marker)
        with pytest.raises(UsageError, match="not written by pploader"):
            outputs.claim_output(out, "OUT", command="test", force=True)
    (out / outputs.MARKER).write_text(json.dumps({"by": "pploader", "files": ["data.bin"]}))
    assert outputs.claim_output(out, "OUT", command="test", force=True).owned == ("data.bin",)


def test_a_users_file_with_an_output_name_is_never_replaced(tmp_path: Path) -> None:
    """A file the user put into pploader's own directory under a name the new output would
    use: refused before anything moves (the marker does not list it)."""
    out = tmp_path / "out"
    target = outputs.claim_output(out, "OUT", command="test")
    with outputs.staged_output(target) as tmp:
        (tmp / "a.bin").write_bytes(b"pploader's")
    (out / "b.bin").write_bytes(b"the user's")
    with pytest.raises(UsageError, match="b.bin there is not pploader's"):
        outputs.claim_output(out, "OUT", command="test", reuse=True, expect=["b.bin"])
    again = outputs.claim_output(out, "OUT", command="test", force=True)
    with pytest.raises(UsageError, match="b.bin there is not pploader's"):
        with outputs.staged_output(again) as tmp:
            (tmp / "b.bin").write_bytes(b"new")
    assert (out / "b.bin").read_bytes() == b"the user's" and (out / "a.bin").exists()
    assert sorted(os.listdir(out)) == [outputs.MARKER, "a.bin", "b.bin"]  # no temporary left
