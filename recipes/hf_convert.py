"""Convert between Hugging Face LLaMA folders and this repo's checkpoints.

    python -m recipes.hf_convert import HF_DIR OUT_DIR
        HF folder (config.json + safetensors, sharded or not) -> Orbax weights folder.
        Train from it:  python -m recipes.pretrain trainer.init_from=OUT_DIR [...]
        (trainer.init_from also accepts the HF folder itself; the Orbax copy restores
        faster and onto any device layout.)

    python -m recipes.hf_convert export SRC OUT_HF [--step N] [--dtype float32|bfloat16] [--shard-mb MB]
        run_dir (newest complete checkpoint, or --step), weights folder or HF folder -> HF folder
        that transformers' LlamaForCausalLM.from_pretrained loads.
"""

from __future__ import annotations

import argparse
import sys

from lib.errors import run_cli
from lib.hf import load_llama, save_llama
from lib.weights import load_model, read_architecture, save_weights


def import_hf(hf_dir: str, out_dir: str) -> None:
    model, cfg = load_llama(hf_dir)
    save_weights(model, out_dir, source=str(hf_dir))
    print(f"imported {hf_dir} ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}) -> {out_dir}", file=sys.stderr)
    print(f"train from it: python -m recipes.pretrain trainer.init_from={out_dir} ...", file=sys.stderr)


def export_hf(src: str, out_dir: str, step: int | None, dtype: str, shard_mb: int, overwrite: bool) -> None:
    cfg = read_architecture(src, step)
    model = load_model(src, cfg, step)
    save_llama(model, cfg, out_dir, dtype=dtype, max_shard_bytes=shard_mb << 20, overwrite=overwrite)
    print(f"exported {src}{'' if step is None else f' step {step}'} -> {out_dir} ({dtype})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.hf_convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="direction", required=True)
    p_import = sub.add_parser("import", help="HF folder -> Orbax weights folder")
    p_import.add_argument("hf_dir")
    p_import.add_argument("out_dir")
    p_export = sub.add_parser("export", help="run_dir / weights folder -> HF folder")
    p_export.add_argument("src")
    p_export.add_argument("out_dir")
    p_export.add_argument("--step", type=int, default=None, help="checkpoint step of a run_dir (default: newest complete)")
    p_export.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p_export.add_argument("--shard-mb", type=int, default=4096, help="largest safetensors file, MiB")
    p_export.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.direction == "import":
        return run_cli(lambda: import_hf(args.hf_dir, args.out_dir))
    return run_cli(lambda: export_hf(args.src, args.out_dir, args.step, args.dtype, args.shard_mb, args.overwrite))


if __name__ == "__main__":
    sys.exit(main())
