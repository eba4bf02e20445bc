"""Write scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, no download) as an
ImageFolder of 32x32 RGB PNGs: a real image-classification set for trying the recipes offline.

    python scripts/make_digits.py data/digits    # -> data/digits/{train,val}/<digit>/<n>.png
"""

import sys
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.args import ArgumentParser  # noqa: E402

DIGITS = 1797  # scikit-learn's 8x8 digits


def write_digits(root, val_size=397, size=32, seed=0):
    """Split the digits into train and val (`val_size` images, odd by default so that evaluation
    in 2 processes has a remainder) and write them as PNGs. Returns (train count, val count)."""
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    for split, indices in (("val", order[:val_size]), ("train", order[val_size:])):
        for i in indices:
            folder = Path(root) / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (digits.images[i] * (255 / 16)).astype(np.uint8)
            Image.fromarray(pixels).resize((size, size), Image.NEAREST).convert("RGB").save(folder / f"{i}.png")
    return len(order) - val_size, val_size


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", help="output folder")
    parser.add_argument("--val_size", type="positive_int", default=397, help="images held out, of the 1797")
    parser.checks = [_check_val_size]
    return parser


def _check_val_size(parser, args) -> None:
    if args.val_size >= DIGITS:
        parser.error(
            f"--val_size {args.val_size} leaves no training image of the {DIGITS}: pass at most {DIGITS - 1}",
            subject="--val_size",
        )


if __name__ == "__main__":
    args = build_parser().parse_args()
    n_train, n_val = write_digits(args.root, args.val_size)
    print(f"wrote {n_train} training and {n_val} validation images to {args.root}")
