"""Pipeline forward of a transformers checkpoint, one PP stage per rank, loaded by pploader.

Every rank builds only its stage (meta skeleton + its own layers, read by pploader), then the
hidden states go stage to stage; the last rank prints the logits' summary and, with
``--check``, compares them to the single-process model loaded by ``from_pretrained``::

    python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        docs/examples/hf_pipeline_forward.py MODEL_DIR --check
    # or: PPLOADER_ENTRY=docs/examples/hf_pipeline_forward.py NPROC_PER_NODE=3 \\
    #     launch/torchrun.sh MODEL_DIR --check

MODEL_DIR is a ``save_pretrained`` directory of a supported architecture (``pploader plan``
lists them when given an unsupported one).
"""
from __future__ import annotations

import argparse

import torch

from pploader import Topology
from pploader.distributed.bootstrap import init_distributed
from pploader.distributed.comm import Comm, run_guarded
from pploader.integrations.hf import HFStage, build_stage, pipeline_forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--tokens", type=int, default=16, help="sequence length")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random token ids")
    parser.add_argument("--check", action="store_true",
                        help="last rank: compare with the single-process transformers model")
    args = parser.parse_args()

    launch = init_distributed(backend="gloo")
    topo = Topology.for_world(launch.world_size, launch.rank)
    comm = Comm(topo)
    # fail together: if any rank cannot build its stage, every rank stops (no hung recv)
    stage: HFStage = run_guarded(comm, lambda: build_stage(args.model_dir, topo))
    w = stage.window
    print(f"rank {topo.rank}: layers {w.start_layer}-{w.end_layer - 1}, "
          f"{stage.parameter_bytes() / 2**20:.1f} MiB of parameters, "
          f"{stage.stats.read_bytes / 2**20:.1f} MiB read", flush=True)

    vocab = stage.model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (1, args.tokens), generator=gen)
    logits = pipeline_forward(stage, ids, comm)
    if logits is not None:
        print(f"rank {topo.rank}: logits {tuple(logits.shape)}, next token "
              f"{int(logits[0, -1].argmax())}", flush=True)
        if args.check:
            import transformers
            arch = stage.model.config.architectures[0]
            ref = getattr(transformers, arch).from_pretrained(args.model_dir, dtype=stage.dtype)
            with torch.no_grad():
                want = ref.eval()(input_ids=ids, use_cache=False).logits
            diff = (logits.float() - want.float()).abs().max().item()
            print(f"max abs diff vs single process: {diff:.3g}", flush=True)
    comm.agree(None)
    comm.close()


if __name__ == "__main__":
    main()
