"""`python recipes/<name>.py ...` in a process forked from this one, which has imported torch, torchvision,
transformers, datasets and accelerate once: the same code from its first line, the same exit code and output, without
the ten seconds of imports each run would spend (most of a refusal test's time). conftest.run uses it for one-process
runs of a recipe whose environment matches this process's in every variable those libraries read when imported.
Its first line out is the environment it imported them in.

Protocol, one JSON line each way: {"argv", "env", "cwd", "stdout", "stderr"} in; {"pid"} then {"returncode"} out."""

import importlib
import json
import os
import runpy
import sys

STARTED_WITH = dict(os.environ)
# What a recipe imports before its first line of its own runs, and what transformers imports when it reads a Llama
# config (torchvision, torch._dynamo): seconds each, the same in every run.
for name in ("torch", "torchvision", "accelerate", "datasets", "transformers.models.llama.modeling_llama"):
    importlib.import_module(name)
for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):  # transformers' lazy names
    getattr(importlib.import_module("transformers"), name)
SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in STARTED_WITH}  # torch's inductor cache folder


def _child(request: dict) -> None:
    """Become `python argv...`: its environment, folder, output files, arguments and __main__; never return."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**SET_BY_IMPORTS, **request["env"]})
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        script = request["argv"][1]
        sys.argv = request["argv"][1:]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        atexit._run_exitfuncs()  # what the interpreter's exit runs (trackers, logging); not the fork's teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    reply = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            sys.stdin.close()
            _child(request)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


if __name__ == "__main__":
    print(json.dumps({"environment": STARTED_WITH}), flush=True)  # the one the libraries were imported in
    serve()
