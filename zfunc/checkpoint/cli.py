"""``python -m zfunc.checkpoint``: consolidate a sharded checkpoint into one ``state_dict`` (or one
``.safetensors`` file), or export it as a Hugging Face model folder, one unit in memory at a time."""
from __future__ import annotations

import argparse
import sys

import torch

from .hf_export import safetensors_from_saved
from .hf_files import DTYPES
from .sharded import Saved, consolidate, export_hf, resolve



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zfunc.checkpoint", description="Consolidate or export a zfunc checkpoint.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one fp32 state_dict from a sharded checkpoint")
    c.add_argument("directory")
    c.add_argument("out")
    c.add_argument("--tag", default=None, help="default: the checkpoint 'latest' names")
    c.add_argument("--safetensors", action="store_true",
                   help="write one .safetensors file as Hugging Face does: tied weights once, under their first "
                        "name; streamed, one unit in memory at a time")
    e = sub.add_parser("export-hf", help="write a Hugging Face model folder (safetensors shards, index, config.json) "
                                         "from a sharded checkpoint, one unit in memory at a time")
    e.add_argument("directory")
    e.add_argument("out")
    e.add_argument("--tag", default=None, help="default: the checkpoint 'latest' names")
    e.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: each parameter in the dtype the model had (fp32 master weights cast to it)")
    e.add_argument("--max-shard-size", default="5GB", help="bytes, or e.g. 5GB, 500MB (default 5GB)")
    e.add_argument("--config", default=None,
                   help="a folder holding config.json, or a JSON file: written as config.json (without it, "
                        "from_pretrained needs the config from elsewhere)")
    e.add_argument("--overwrite", action="store_true",
                   help="remove another model's files in OUT that this export would leave beside its weights "
                        "(config.json without --config, generation_config.json, other shards, *.bin, adapter files); "
                        "without it such a folder is refused")
    args = parser.parse_args(argv)
    if args.command == "export-hf":
        export_hf(args.directory, args.out, tag=args.tag, dtype=DTYPES.get(args.dtype),
                  max_shard_size=args.max_shard_size, config=args.config, overwrite=args.overwrite)
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    if args.safetensors:
        safetensors_from_saved(Saved(resolve(args.directory, args.tag)), args.out, torch.float32)
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    state_dict = consolidate(args.directory, args.tag)
    torch.save(state_dict, args.out)
    n = sum(v.numel() for v in state_dict.values())
    print(f"wrote {args.out}: {len(state_dict)} tensors, {n} elements", file=sys.stderr)
    return 0
