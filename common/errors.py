"""A refusal as data: a mistake the user can fix, with what it is about, what is wrong and what to do as fields, said
as one `error:` line. Imports nothing: common.args (which launch.sh loads without torch) raises it too."""

from __future__ import annotations


class RecipeError(Exception):
    """A mistake the user can fix: one `error:` line, exit code 2, said by rank 0 alone unless one rank may meet it
    alone (`same_on_every_rank=False`); under launch.sh by the first process of a node to end (first_to_say).

    Its parts are fields, which tests and callers read instead of the wording:
    - `problem`: what is wrong, as the line says it, naming the subject where the sentence does
      ("--output_dir x already holds a run (...)", "checkpoint x holds another model (...)");
    - `fix`: what to do, a fix that works when followed literally ("pass --resume_from_checkpoint latest ...");
    - `subject`: the option ("--block_size") or the path as the user gave it that the problem is about; the line
      names it. A refusal about two things that disagree (a checkpoint's layout against this run's config, two
      options that exclude each other) takes as subject the option its fix changes first, the one the line opens
      with; it has none (None) where no option or path of the user's is at fault (a full disk, a library's refusal).
    The line is `f"{problem}; {fix}"`, or `problem` alone where the problem says the fix itself. The fields travel in
    __dict__: pickled by decide_on_main's broadcast, a refusal arrives whole on every process."""

    def __init__(self, problem: str, fix: str | None = None, *, subject: str | None = None,
                 same_on_every_rank: bool = True):  # fmt: skip
        super().__init__(problem if fix is None else f"{problem}; {fix}")
        self.problem, self.fix, self.subject = problem, fix, subject
        self.same_on_every_rank = same_on_every_rank


class DataError(RecipeError):
    """Bad data met by one process, often in a DataLoader worker (`one_line` recovers its message); its subject is
    the file or the option of the data."""

    def __init__(self, problem: str, fix: str | None = None, *, subject: str | None = None,
                 same_on_every_rank: bool = False):  # fmt: skip
        super().__init__(problem, fix, subject=subject, same_on_every_rank=same_on_every_rank)
