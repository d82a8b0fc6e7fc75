"""A vLLM engine in its own process, driven over stdin/stdout with one JSON object per line.

    python -m tests.vllm.engine_proc MODEL_DIR '{"tensor_parallel_size": 1, ...}' [CONNECTOR_JSON]

Requests: {"op": "generate", "prompts": [[ids...]], "max_tokens": N, "params": [dict|null]}
          -> {"outputs": [{"token_ids": [...], "logprobs": [...], "kv_transfer_params": {...}|null}]}
          {"op": "blocks_free", "timeout_s": S} -> {"free": bool}: whether the engine holds no KV
          block (within S seconds); {"op": "kvsvc_totals"} -> {"totals": {...}}: the kvsvc
          connector's transfers since start, summed over the workers; {"op": "stop"}.
          The engine answers {"ready": true} once started.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _kvsvc_totals(worker: object) -> dict[str, int]:
    """In each worker: its kvsvc connector's transfer totals."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().transfer_totals()


def main() -> None:
    model, engine_args = sys.argv[1], json.loads(sys.argv[2])
    connector = json.loads(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The protocol keeps the real stdout; everything else (vLLM's logs, its engine
    # processes) writes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from tests.vllm.engines import kernel_block_size

    kw = dict(model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=512,
              block_size=kernel_block_size())
    kw.update(engine_args)
    if connector:
        kw["kv_transfer_config"] = KVTransferConfig(**connector)
    llm = LLM(**kw)
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "stop":
            break
        if req["op"] == "blocks_free":  # True once no KV block is held (vLLM resets the prefix cache only then)
            deadline = time.monotonic() + req.get("timeout_s", 60)
            free = llm.reset_prefix_cache()
            while not free and time.monotonic() < deadline:
                time.sleep(0.2)
                free = llm.reset_prefix_cache()
            out.write(json.dumps({"free": free}) + "\n")
            out.flush()
            continue
        if req["op"] == "kvsvc_totals":
            totals: dict[str, int] = {}
            for per_worker in llm.collective_rpc(_kvsvc_totals):
                for k, v in per_worker.items():
                    totals[k] = totals.get(k, 0) + v
            out.write(json.dumps({"totals": totals}) + "\n")
            out.flush()
            continue
        sps = []
        for p in req["params"]:
            extra = {"kv_transfer_params": p} if p is not None else None
            sps.append(SamplingParams(max_tokens=req["max_tokens"], temperature=0, logprobs=1, extra_args=extra,
                                      ignore_eos=req.get("ignore_eos", False)))
        results = llm.generate([{"prompt_token_ids": ids} for ids in req["prompts"]], sps, use_tqdm=False)
        outputs = []
        for r in results:
            o = r.outputs[0]
            lps = [float(d[t].logprob) for d, t in zip(o.logprobs or [], o.token_ids, strict=False)]
            outputs.append({"token_ids": list(o.token_ids), "logprobs": lps, "kv_transfer_params": r.kv_transfer_params,
                            "num_cached_tokens": r.num_cached_tokens})
        out.write(json.dumps({"outputs": outputs}) + "\n")
        out.flush()
    del llm


if __name__ == "__main__":
    main()
