"""Pretrain a tiny decoder on the bundled synthetic corpus.

python recipes/pretrain_tiny.py [train.max_steps=100 ...]
fabric run --accelerator cpu --devices 2 --strategy ddp recipes/pretrain_tiny.py
"""

from pathlib import Path

from unicache_train.cli import report_user_errors
from unicache_train.recipe import run_recipe

if __name__ == "__main__":
    report_user_errors(lambda: run_recipe(Path(__file__).with_suffix(".yaml"), doc=__doc__))
