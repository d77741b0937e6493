"""Is a fine-tune a function of its spec? Run one arm's demo spec (``study.py demo_spec``: the
study's seed-0 spec, here at ``--steps`` steps) twice into ``runs/det/{0,1}`` and compare the
exports' sha256.

    python experiments/long_context/determinism_check.py compress [--steps 4]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("arm", choices=["compress", "control"])
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("long_context_study", HERE / "study.py")
    study_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_py)
    from unicache_train.train.finetune import finetune

    study = yaml.safe_load((HERE / "study.yaml").read_text())
    digests = []
    for k in range(2):
        r = finetune(study_py.demo_spec(study, args.arm, args.steps, Path(f"runs/det/{k}")))
        digest = hashlib.sha256((r.export_dir / "model.safetensors").read_bytes()).hexdigest()
        digests.append(digest)
        print(args.arm, k, digest, flush=True)
    print("identical" if digests[0] == digests[1] else "DIFFER")


if __name__ == "__main__":
    main()
