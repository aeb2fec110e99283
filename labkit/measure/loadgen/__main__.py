"""``python -m labkit.measure.loadgen serve``: load an OpenAI-compatible server and report vLLM's serving metrics.

    python -m labkit.measure.loadgen serve --base-url http://127.0.0.1:8000 --dataset random \
        --random-input-len 64 --random-output-len 32 --random-range-ratio 0.5 --num-prompts 64 \
        --request-rate 8 --burstiness 1 --max-concurrency 16 --num-warmups 2 --seed 0 \
        --goodput ttft:500 tpot:50 --result-file run.json

Option names follow ``vllm bench serve``. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import argparse
import sys

from labkit.measure.loadgen.datasets import ChatLikeDataset, RandomDataset, SharedPrefixDataset
from labkit.measure.loadgen.metrics import parse_goodput
from labkit.measure.loadgen.runner import ServeBenchConfig, benchmark_serving


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit.measure.loadgen", description="labkit's load generator")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="benchmark an OpenAI-compatible server under load")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (no /v1)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for prompt lengths (default: bundled)")
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=["random", "shared-prefix", "chat-like"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--random-input-len", type=int, default=64)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=128, help="shared-prefix: tokens per prefix")
    p.add_argument("--suffix-len", type=int, default=16, help="shared-prefix: tokens after the prefix")
    p.add_argument("--output-len", type=int, default=32, help="shared-prefix: output tokens")
    p.add_argument("--chat-input-median", type=int, default=48)
    p.add_argument("--chat-output-median", type=int, default=48)
    p.add_argument("--chat-sigma", type=float, default=0.8)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; < 1 burstier; > 1 more even")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--result-file", default=None, help="write the result (vLLM's keys + every request) as JSON")
    p.add_argument("--disable-tqdm", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.dataset == "random":
            dataset = RandomDataset(a.random_input_len, a.random_output_len, a.random_range_ratio, a.random_prefix_len)
        elif a.dataset == "shared-prefix":
            dataset = SharedPrefixDataset(a.num_prefixes, a.prefix_len, a.suffix_len, a.output_len)
        else:
            dataset = ChatLikeDataset(a.chat_input_median, a.chat_output_median, a.chat_sigma)
        config = ServeBenchConfig(
            base_url=a.base_url, dataset=dataset, num_prompts=a.num_prompts, endpoint=a.endpoint, model=a.model,
            request_rate=a.request_rate, burstiness=a.burstiness, max_concurrency=a.max_concurrency,
            num_warmups=a.num_warmups, seed=a.seed, goodput=parse_goodput(a.goodput), ignore_eos=a.ignore_eos,
            temperature=a.temperature, tokenizer=a.tokenizer, disable_tqdm=a.disable_tqdm)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = benchmark_serving(config)
    result.print_report()
    if a.result_file:
        print(f"result written to {result.save(a.result_file)}")
    return 0 if result.metrics.completed else 1


if __name__ == "__main__":
    sys.exit(main())
