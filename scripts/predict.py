"""Labels for images from a finished run of the image recipe: its model rebuilt as the run built it (its saved
arguments, its model.safetensors) and each image transformed as its evaluation transformed the held-out set.

    python scripts/predict.py outputs/digits data/digits/val/3/17.png photo.jpg
    python scripts/predict.py outputs/digits --json --top_k 1 images/*.png

One line per image, its path and the --top_k labels with their probabilities (--json: a JSON object a line). A
folder that is no finished image run, or an image that does not decode, is one error line and exit 2."""

import json
import sys
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.args import ArgumentParser  # noqa: E402


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("run_dir", help="the --output_dir of a finished recipes/cifar.py run")
    p.add_argument("images", nargs="+", help="image files (any format PIL decodes)")
    p.add_argument("--top_k", type="positive_int", default=3, help="labels shown per image")
    p.add_argument("--batch_size", type="positive_int", default=64)
    p.add_argument("--json", action="store_true", help='one {"image", "labels": [{"label", "probability"}]} a line')
    return p.parse_args(argv)


def load_run(run_dir: Path):
    """(model in eval mode, the evaluation transform, the class names) of the image-recipe run in `run_dir`."""
    from safetensors.torch import load_file

    from common.runtime import RecipeError, one_line
    from common.vision import build_model, image_size_and_stats
    from recipes.cifar import eval_transform

    fix = "pass the --output_dir of a finished recipes/cifar.py run"
    if not run_dir.is_dir():
        raise RecipeError(f"{run_dir}: no such folder; {fix}", subject=str(run_dir))
    try:
        record = json.loads((run_dir / "results.json").read_text())
        saved, classes = record["args"], record["class_names"]
    except (OSError, ValueError, KeyError, TypeError) as err:  # not a run, one still training, an older one's record
        why = "no results.json" if isinstance(err, OSError) else f"its results.json lacks {err}"
        raise RecipeError(f"{run_dir}: not a finished image-recipe run ({why}); {fix}", subject=str(run_dir)) from err
    if saved.get("recipe") != "cifar":
        raise RecipeError(
            f"{run_dir}: a run of recipes/{saved.get('recipe')}.py, not the image recipe; {fix}", subject=str(run_dir)
        )
    weights = run_dir / "model.safetensors"
    if not weights.is_file():
        raise RecipeError(
            f"{weights}: no such file, and the run's results.json says it finished; {fix} whole", subject=str(weights)
        )
    size, mean, std = image_size_and_stats(Namespace(**saved))
    # the run's model, its weights from the file: none downloaded or read from --pretrained_path
    model = build_model(Namespace(**{**saved, "pretrained": False, "pretrained_path": None}), len(classes), False)
    try:
        model.load_state_dict(load_file(weights))
    except Exception as err:  # cut short, damaged, or another model's (safetensors' and torch's own errors)
        raise RecipeError(
            f"{weights} does not load into the model its results.json describes ({one_line(err)}); it is damaged or "
            f"another run's: {fix} whole",
            subject=str(weights),
        ) from err
    return model.eval(), eval_transform(size, mean, std), classes


def main(argv=None):
    args = parse_args(argv)
    import torch
    from accelerate import PartialState

    from common.runtime import RecipeError
    from common.vision import load_image

    PartialState()  # one process: the recipes' logger needs it
    model, transform, classes = load_run(Path(args.run_dir))
    if missing := [path for path in args.images if not Path(path).is_file()]:
        what = (
            "a folder, not an image file: pass the images in it" if Path(missing[0]).is_dir() else "no such image file"
        )
        raise RecipeError(
            f"{missing[0]}: {what}; check the path" if "no such" in what else f"{missing[0]}: {what}",
            subject=str(missing[0]),
        )
    images = [transform(load_image(path)) for path in args.images]  # a file that does not decode: one line, exit 2
    with torch.no_grad():
        probabilities = torch.cat([model(torch.stack(b)).softmax(-1) for b in _batches(images, args.batch_size)])
    top = probabilities.topk(min(args.top_k, len(classes)), dim=-1)
    for path, values, indices in zip(args.images, top.values.tolist(), top.indices.tolist()):
        labels = [(classes[i], p) for i, p in zip(indices, values)]
        if args.json:
            print(json.dumps({"image": path, "labels": [{"label": c, "probability": p} for c, p in labels]}))
        else:
            print(f"{path}: " + ", ".join(f"{c} {p:.4f}" for c, p in labels))


def _batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


if __name__ == "__main__":
    from common.runtime import exit_codes

    with exit_codes():  # a mistake: one error line, exit 2
        main()
