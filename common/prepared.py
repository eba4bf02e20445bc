"""Prepared data: token blocks written once with datasets' save_to_disk beside a manifest of what they were made
from (the sources' digests, the tokenizer's, the settings), and reused by every later run and node with the same
inputs. load_from_disk memory-maps the Arrow files, so a training process's memory does not grow with the corpus.

    <folder>/manifest.json           inputs, their digest, each split's counts and each part's files and sizes
    <folder>/<split>/part-NNNNN/     one chunk's blocks (save_to_disk); the split is their concatenation
    .<folder>.<digest>.partial/      a preparation in progress: parts done so far, renamed into place when all are
    .<folder>.<digest>.lock          held by the one run preparing them (others with the same inputs wait for it)

A preparation goes in chunks, each saved when done, so an interrupted one resumes at the first chunk it had not
finished; the folder appears whole, by one rename, or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from .checkpoint import write_json
from .preemption import stop_before_training
from .runtime import RecipeError, logger

FORMAT_VERSION = 2  # how blocks are made and laid out: a change makes earlier folders another input (2: int32)
MANIFEST = "manifest.json"
HELD_OUT_FILE = "held_out.jsonl"  # the first held-out rows, as read: the default prompts of common.samples
HELD_OUT_ROWS = 100
PART_INFO = "part.json"  # in a part folder: its counts, written last (a part with it is complete)
# Raw text per chunk: what an interrupted preparation loses at most, and the progress bar's step. The tests set
# the environment variable to a few kilobytes to interrupt a preparation between chunks.
CHUNK_BYTES = 64 * 2**20
CHUNK_BYTES_ENV = "RECIPES_PREPARE_CHUNK_BYTES"
# Below this much text, one process tokenizes: a pool's start (forking, pickling the tokenizer, a file per worker)
# costs more than it saves (benchmarks/prepare.py)
SMALL_DATA_BYTES = 16 * 2**20
MAX_WORKERS = 32  # a node's cores beyond this add little: the parts are written one at a time
SETTLED_SECONDS = 3.0  # a file changed longer ago than this has its digest remembered (file_sha256)
LOCK_BEAT = 1.0  # seconds between two looks at another run's preparation of the same inputs


# Identity ------------------------------------------------------------------------------------------------------


def file_sha256(path) -> str:
    """The sha256 of a file's bytes, remembered by its device, inode, size, mtime and ctime: a write changes the
    ctime, which nothing sets back, so a corpus of gigabytes is read once, not by every process of every run. A
    file written in the last seconds is not remembered (a coarse clock could miss a second write), as git does."""
    key, memo = _stat_key(path), _digest_memo(path)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        saved = json.loads(memo.read_text())
        if saved["stat"] == key:
            return saved["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 * 2**20):
            digest.update(block)
    settled = time.time() - key[4] / 1e9 > SETTLED_SECONDS  # key[4]: the ctime
    if settled and _stat_key(path) == key:  # and not written while it was read
        with contextlib.suppress(OSError):  # a read-only cache: hashed again next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            write_json(memo, {"path": str(Path(path).resolve()), "stat": key, "sha256": digest.hexdigest()})
    return digest.hexdigest()


def _stat_key(path) -> list:
    stat = os.stat(path)
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _digest_memo(path) -> Path:
    """Where file_sha256 remembers a file's digest: in the datasets cache, one small file per path."""
    import datasets

    name = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:32]
    return Path(datasets.config.HF_DATASETS_CACHE) / "file_digests" / f"{name}.json"


def tokenizer_identity(tokenizer) -> dict:
    """What decides the tokens a tokenizer makes: its serialized vocabulary, merges, normalizer and special tokens
    (a fast tokenizer's tokenizer.json; a slow one's vocabulary files), its EOS and its chat template."""
    if getattr(tokenizer, "is_fast", False):
        vocabulary = tokenizer.backend_tokenizer.to_str().encode()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            files = tokenizer.save_vocabulary(tmp)
            vocabulary = b"".join(Path(f).read_bytes() for f in sorted(files))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(
        tokenizer.chat_template, sort_keys=True
    )  # fmt: skip
    return {
        "class": type(tokenizer).__name__,
        "vocabulary_sha256": hashlib.sha256(vocabulary).hexdigest(),
        "eos_token_id": tokenizer.eos_token_id,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if tokenizer.chat_template else None,
    }


def inputs_digest(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def describe_blocks(inputs: dict, split: str) -> str:
    """The description (datasets' DatasetInfo) of one split's blocks: what they are made from, by digest, without the
    other split's file. common.data.fingerprint reads it, so a checkpoint resumes only blocks of the same inputs
    whatever blocks it samples, and a new --validation_file leaves the train blocks' identity as it was."""
    other = "validation" if split == "train" else "train"
    own = {key: value for key, value in inputs.items() if key != f"{other}_file"}
    if "dataset" in own:
        own["dataset"] = {key: value for key, value in own["dataset"].items() if key != other}
    return f"{split} token blocks prepared from inputs {inputs_digest(own)}"


def default_folder(digest: str) -> Path:
    """Under the datasets cache (HF_DATASETS_CACHE), named by the inputs' digest: a default never mismatches."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "prepared" / digest


# What differs, said as the option that changed it: (key of the inputs, how the option is named)
DIFFERENCES = (
    ("version", "version of the recipes' packing"),
    ("train_file", "--train_file"),
    ("validation_file", "--validation_file"),
    ("dataset", "--dataset_name (or --dataset_config_name, or the dataset's files)"),
    ("held_out", "--validation_split_percentage or --seed (the held-out rows)"),
    ("tokenizer", "tokenizer (--tokenizer_name, or the model's)"),
    ("block_size", "--block_size"),
    ("data_format", "--data_format"),
    ("text_column", "--text_column"),
)


def _short(value) -> str:
    """A value of the inputs as an error line shows it: digests cut to 12 characters."""
    if isinstance(value, dict):
        if "sha256" in value:
            return f"sha256 {value['sha256'][:12]}"
        changed = {k: v for k, v in value.items() if v is not None}
        return ", ".join(f"{k} {_short(v)}" for k, v in sorted(changed.items())) or "none"
    if isinstance(value, str) and len(value) >= 40:
        return value[:12]
    return str(value)


def difference(saved: dict, now: dict) -> str:
    """`another <option> (<theirs> vs <this run's>)` for the first input that differs."""
    for key, option in DIFFERENCES:
        if saved.get(key) != now.get(key):
            theirs, ours = saved.get(key), now.get(key)
            if isinstance(theirs, dict) and isinstance(ours, dict):  # the field that differs, not all of them
                keys = [k for k in {**ours, **theirs} if theirs.get(k) != ours.get(k)]
                theirs, ours = ({k: d.get(k) for k in keys} for d in (theirs, ours))
                if "sha256" in keys:
                    theirs, ours = saved[key], now[key]
            return f"another {option} ({_short(theirs)} vs {_short(ours)} now)"
    return "other inputs"


# Reading -------------------------------------------------------------------------------------------------------


def _damage(folder: Path, manifest: dict) -> str | None:
    """What is missing or cut short in a prepared folder, by the files and sizes its manifest lists (stat alone:
    seconds for any corpus), or None."""
    for split, info in manifest["splits"].items():
        for part in info["parts"]:
            for name, size in part["files"].items():
                path = folder / split / part["name"] / name
                if not path.is_file():
                    return f"{path.relative_to(folder)} is missing"
                if path.stat().st_size != size:
                    return f"{path.relative_to(folder)} has {path.stat().st_size:,} bytes, not {size:,}"
    return None


def find_prepared(folder: Path, inputs: dict, named: bool) -> dict | None:
    """The manifest of `folder` if it holds complete blocks of `inputs`; None if there are none yet (or, in the
    default location, damaged ones: prepared again). A folder the user named that holds other data, damaged
    blocks or other files is refused in one line, and left as it is."""
    flag = f"--prepared_data_dir {folder}"
    fix = "pass another --prepared_data_dir, or leave it out (a folder named by the inputs, in the datasets cache)"
    if not folder.exists():
        return None
    if not folder.is_dir():
        raise RecipeError(f"{flag} is a file, not a folder; {fix}", subject="--prepared_data_dir")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        assert isinstance(manifest["inputs"], dict) and isinstance(manifest["splits"], dict)
        damage = _damage(folder, manifest)
    except FileNotFoundError:
        if not any(folder.iterdir()):  # an empty folder the user made for it
            return None
        damage = f"it has no {MANIFEST}"
        if named:
            raise RecipeError(
                f"{flag} holds files that are not prepared data ({damage}); {fix}", subject="--prepared_data_dir"
            ) from None
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as err:
        damage = f"its {MANIFEST} does not parse ({type(err).__name__})"
    if damage is None and manifest["inputs"] != inputs:
        if named:
            raise RecipeError(
                f"{flag} was prepared from {difference(manifest['inputs'], inputs)}; {fix}",
                subject="--prepared_data_dir",
            )
        damage = "it was prepared from other inputs"
    if damage is None:
        return manifest
    if named:
        raise RecipeError(
            f"{flag} is damaged ({damage}); delete it to prepare it again, or pass another --prepared_data_dir",
            subject="--prepared_data_dir",
        )
    logger.warning(f"prepared data in {folder} is damaged ({damage}): preparing it again")
    return None


def load_prepared(folder: Path, manifest: dict):
    """The DatasetDict of a prepared folder: each split its parts concatenated, memory-mapped."""
    from datasets import DatasetDict, concatenate_datasets, load_from_disk

    return DatasetDict(
        {
            split: concatenate_datasets(
                [load_from_disk(str(folder / split / p["name"])) for p in info["parts"] if p["blocks"]]
            )  # a chunk of blank rows has none
            for split, info in manifest["splits"].items()
        }
    )


# Writing -------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def one_preparation(folder: Path, digest: str, stalled_after: int):
    """Held while this process prepares `folder`: another run of the same inputs (a sweep's jobs started together,
    a node sharing the folder) waits for it and then reuses what it prepared. The lock is the kernel's (filelock, as
    datasets' own), so it goes with a process that dies, and the one waiting resumes its chunks. The wait lasts as
    long as the other preparation writes; one that wrote nothing for `stalled_after` s (--ddp_timeout) is said in one
    line. A stop signal is honoured while waiting."""
    from filelock import FileLock, Timeout

    folder.parent.mkdir(parents=True, exist_ok=True)
    lock, partial = FileLock(str(folder.parent / f".{folder.name}.{digest}.lock")), partial_folder(folder, digest)
    newest, since, said = None, time.monotonic(), False
    while True:
        try:
            lock.acquire(timeout=LOCK_BEAT)
            break
        except Timeout:
            if (stop := stop_before_training()) is not None:
                raise stop from None
            if not said:
                logger.info(f"another run is preparing the same data into {folder}: waiting for it, to reuse it")
                said = True
            if (now := _last_written(partial)) != newest:
                newest, since = now, time.monotonic()
            elif time.monotonic() - since > stalled_after:
                raise RecipeError(
                    f"another run has prepared the same data into {folder} and written nothing for {stalled_after} s "
                    f"(--ddp_timeout; it holds {lock.lock_file}): a process stopped or stalled; end it, or pass "
                    "another --prepared_data_dir",
                    subject="--prepared_data_dir",
                ) from None
    try:
        yield
        with contextlib.suppress(OSError):  # prepared: who takes the lock next finds the folder, not a new lock
            os.unlink(lock.lock_file)
    finally:
        lock.release()


def _last_written(folder: Path) -> tuple:
    """The newest modification time under `folder` and how many files it holds: what a preparation changes as it
    goes (datasets writes its files in batches of rows). Files that go while it looks are passed over."""
    times = []
    for root, _, files in os.walk(folder):  # errors (a folder removed meanwhile) ignored
        for name in files:
            with contextlib.suppress(OSError):
                times.append(os.stat(os.path.join(root, name)).st_mtime_ns)
    return max(times, default=0), len(times)


def chunk_bytes() -> int:
    return int(os.environ.get(CHUNK_BYTES_ENV, CHUNK_BYTES))


def text_bytes(data) -> int:
    """The bytes of a dataset's rows in Arrow (a selection of a table: its share of the table)."""
    table = data.data
    return table.nbytes * len(data) // max(table.num_rows, 1)


def default_workers(nbytes: int) -> int:
    """--preprocessing_num_workers by default: one for small data, else the CPUs this process may use (capped)."""
    if nbytes < SMALL_DATA_BYTES:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cpus))


def partial_folder(folder: Path, digest: str) -> Path:
    """A sibling (one filesystem, so a rename installs it) named by the inputs: another preparation's parts never
    mix with these."""
    return folder.parent / f".{folder.name}.{digest}.partial"


def _part_files(path: Path) -> dict:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file() and p.name != PART_INFO}


def write_part(path: Path, blocks, counts: dict) -> dict:
    """`blocks` saved as part folder `path`: written beside it, its counts last, renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    blocks.save_to_disk(str(tmp))
    info = {**counts, "name": path.name, "files": _part_files(tmp)}
    write_json(tmp / PART_INFO, info)
    os.replace(tmp, path)
    return info


def read_part(path: Path) -> dict | None:
    """The counts of a complete part, or None (not written yet, or cut short)."""
    try:
        info = json.loads((path / PART_INFO).read_text())
    except (OSError, ValueError):
        return None
    return info if _part_files(path) == info.get("files") else None


def install(partial: Path, folder: Path, manifest: dict) -> None:
    """The manifest written, then the partial folder renamed to `folder` (replacing an empty one, or damaged
    blocks in the default location, which this code wrote)."""
    write_json(partial / MANIFEST, manifest)
    folder.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if folder.exists() and any(folder.iterdir()):
        old = folder.with_name(f".{folder.name}.damaged-{os.getpid()}")
        os.replace(folder, old)
    elif folder.exists():
        folder.rmdir()
    os.replace(partial, folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Progress:
    """One bar over the corpus in tokens/s, its total estimated from the raw bytes (tokens per byte so far). Chunks
    are counted once a quarter of one chunk's bytes is done: a small held-out split alone, its few tokens over the
    map's start-up, showed a rate of a thousand tokens/s and an ETA of hours for a corpus of minutes."""

    def __init__(self, total_bytes: int, done_bytes: int, done_tokens: int, desc: str):
        from tqdm.auto import tqdm

        self.total_bytes, self.bytes, self.started = max(total_bytes, 1), done_bytes, time.monotonic()
        self.shown_from = done_bytes + min(chunk_bytes() // 4, total_bytes - done_bytes)
        self.held = 0  # tokens done and not yet counted
        self.bar = tqdm(total=None, initial=done_tokens, unit="tok", unit_scale=True, desc=desc, dynamic_ncols=True)

    def add(self, nbytes: int, tokens: int) -> None:
        self.bytes, self.held = self.bytes + nbytes, self.held + tokens
        if self.bytes >= self.shown_from:
            self.bar.total = int((self.bar.n + self.held) * self.total_bytes / max(self.bytes, 1))
            self.bar.update(self.held)
            self.held = 0

    def close(self) -> float:
        self.bar.close()
        return time.monotonic() - self.started

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
