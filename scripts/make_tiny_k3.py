"""Build the embedded tiny K3-architecture model (or a bigger one with the same recipe).

    python scripts/make_tiny_k3.py --out /tmp/tiny-k3
    python scripts/make_tiny_k3.py --out /tmp/k3-wide --hidden-size 512 --num-layers 16

With no dimension flags the result is identical to what `python -m sglang_k3.launch_server`
serves by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from sglang_k3.model.tiny_build import build
from sglang_k3.model.tiny_spec import TinyK3Spec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created; files are overwritten)")
    for f in dataclasses.fields(TinyK3Spec):
        p.add_argument(
            "--" + f.name.replace("_", "-"), type=type(f.default), default=f.default, help=f"(default: {f.default})"
        )
    p.add_argument(
        "--torch-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="torch_dtype written to config.json (default float32; bfloat16 for SGLang's GPU kernels, "
        "whose rmsnorm has no fp32 kernel). The weights are stored in fp32 either way.",
    )
    args = p.parse_args(argv)
    spec = TinyK3Spec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TinyK3Spec)})
    if spec.num_layers < spec.kda_every or spec.hidden_size <= 0 or spec.experts_per_token > spec.num_experts:
        p.error("need num_layers >= kda_every, hidden_size > 0 and experts_per_token <= num_experts")
    if not 0 < spec.kda_decay_min < spec.kda_decay_max:
        p.error("need 0 < kda_decay_min < kda_decay_max (the range of each KDA head's decay rate exp(A_log))")
    print(f"building {spec} into {args.out}", file=sys.stderr)
    build(args.out, spec)
    if args.torch_dtype != "float32":
        cfg_path = os.path.join(args.out, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["torch_dtype"] = args.torch_dtype
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
