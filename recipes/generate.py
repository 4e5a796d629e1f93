"""Generate text from a trained checkpoint, streaming it to the console:

    python -m recipes.generate run_dir=runs/quickstart prompt="def fibonacci(n):" max_tokens=200
    python -m recipes.generate run_dir=runs/quickstart prompt="import " temperature=0.8 top_k=50 top_p=0.95 seed=1

temperature=0 (the default) is greedy decoding; step=N picks a checkpoint
(default: the newest). Generation stops at max_tokens or at the end-of-document
token. The prompt is preceded by that token, as every document was in training.
"""

from __future__ import annotations

import sys

from lib.config import ConfigError
from lib.corpus import EOS_ID
from lib.errors import run_cli
from lib.generate import generate_tokens, stream_text
from lib.trained_run import open_run

DEFAULTS = {"run_dir": "", "step": "", "prompt": "", "max_tokens": "100", "temperature": "0", "top_k": "0", "top_p": "1", "seed": "0"}
TYPES = {"step": int, "max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int}


def parse(argv: list[str]) -> dict:
    raw = dict(DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in DEFAULTS:
            raise ConfigError(f"unknown argument '{item}'; use key=value with keys {', '.join(DEFAULTS)}")
        raw[key] = value
    if not raw["run_dir"]:
        raise ConfigError("give the run to sample from: run_dir=runs/NAME (the folder recipes.pretrain wrote)")
    args = dict(raw)
    for key, kind in TYPES.items():
        if key == "step" and not raw[key]:
            args[key] = None
            continue
        try:
            args[key] = kind(raw[key])
        except ValueError:
            raise ConfigError(f"{key}={raw[key]!r} is not a {kind.__name__}; for example {key}={DEFAULTS[key] or 100}") from None
    if args["max_tokens"] < 1 or args["temperature"] < 0 or not 0 < args["top_p"] <= 1:
        raise ConfigError("need max_tokens >= 1, temperature >= 0 (0 = greedy) and 0 < top_p <= 1")
    return args


def generate(argv: list[str]) -> str:
    args = parse(argv)
    run = open_run(args["run_dir"], args["step"])
    tokenizer = run.tokenizer()
    prompt_ids = [EOS_ID] + tokenizer.encode(args["prompt"]).ids
    trained = run.cfg.data.seq_len
    if len(prompt_ids) + args["max_tokens"] > trained:
        print(f"note: the model was trained on {trained}-token contexts; text beyond that is usually worse", file=sys.stderr)
    print(f"# {run.run_dir} step {run.step}", file=sys.stderr)
    new_ids = generate_tokens(
        run.model, prompt_ids, max_tokens=args["max_tokens"], temperature=args["temperature"],
        top_k=args["top_k"], top_p=args["top_p"], seed=args["seed"], stop_id=EOS_ID,
    )
    sys.stdout.write(args["prompt"])

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    text = stream_text(tokenizer, new_ids, write)
    sys.stdout.write("\n")
    return text


def main(argv: list[str] | None = None) -> int:
    return run_cli(lambda: generate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
