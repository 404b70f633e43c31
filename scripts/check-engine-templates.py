#!/usr/bin/env python3
"""Checks the agent's command templates for third-party engines against the
engines' own command-line parsers.

The templates are the ones docs/agent.md gives users to copy (its table of
`--engine-command` templates). Each is rendered as the agent renders it
(`{model_path}`, `{model_id}`, `{host}`, `{port}`, `{threads}`, `{gpus}`,
`{gpu_count}`), then parsed by the engine's real parser, imported from an
installation of the engine: vLLM's `vllm serve` parser, SGLang's
`ServerArgs`, llama-cpp-python's `llama_cpp.server` settings. An unknown flag
or a value that does not land where the template means it to fails.
The metric names the agent reads for idleness
(crates/granary-agent/src/activity.rs) are looked up in the same
installations' sources (a counter `x_total` is declared as `x` or `x_total`).

Nothing is started: vLLM and SGLang install from PyPI without a GPU (about
9 GB each, with PyTorch), and their parsers run without one; serving needs
one. Pass the Python of each installation:

    python3 -m venv /tmp/vllm && /tmp/vllm/bin/pip install vllm
    python3 -m venv /tmp/sglang && /tmp/sglang/bin/pip install sglang
    scripts/check-engine-templates.py --vllm /tmp/vllm/bin/python \
        --sglang /tmp/sglang/bin/python --llama-cpp .venv/bin/python

An engine with no interpreter given is reported as skipped (a failure with
--require-all). Exit status 1 if any template fails.
"""

import argparse
import json
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# What the agent substitutes, as the check renders it.
VALUES = {
    "model_path": "/models/smollm2/0.1.2/model.gguf",
    "model_id": "smollm2",
    "host": "127.0.0.1",
    "port": "4242",
    "threads": "2",
    "gpus": "0",
    "gpu_count": "1",
}

# Per engine: the docs table's row label, how the command starts (dropped
# before parsing), a program that builds the real parser and prints the
# parsed values as JSON, and what those values must be.
ENGINES = {
    "vllm": {
        "row": "vLLM",
        "package": "vllm",
        "prefix": ["vllm"],
        "parser": r"""
import json, os, sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand
p = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(p.add_subparsers(dest="subparser"))
a = p.parse_args(sys.argv[1:])
print(json.dumps({"model": a.model_tag, "name": a.served_model_name, "host": a.host,
                  "port": a.port, "gpus": a.tensor_parallel_size}))
""",
        "expect": {"model": VALUES["model_path"], "name": ["smollm2"], "host": "127.0.0.1", "port": 4242, "gpus": 1},
    },
    "sglang": {
        "row": "SGLang",
        "package": "sglang",
        "prefix": ["python", "-m", "sglang.launch_server"],
        "parser": r"""
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(prog="sglang.launch_server")
ServerArgs.add_cli_args(p)
a = p.parse_args(sys.argv[1:])
print(json.dumps({"model": a.model_path, "name": a.served_model_name, "host": a.host,
                  "port": a.port, "gpus": a.tp_size, "metrics": a.enable_metrics}))
""",
        "expect": {
            "model": VALUES["model_path"],
            "name": "smollm2",
            "host": "127.0.0.1",
            "port": 4242,
            "gpus": 1,
            "metrics": True,
        },
    },
    "llama-cpp": {
        "row": "llama_cpp.server",
        "package": None,
        "prefix": ["python", "-m", "llama_cpp.server"],
        "parser": r"""
import argparse, json, sys
from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings
p = argparse.ArgumentParser(prog="llama_cpp.server")
add_args_from_model(p, Settings)
a = p.parse_args(sys.argv[1:])
s, m = parse_model_from_args(ServerSettings, a), parse_model_from_args(ModelSettings, a)
print(json.dumps({"model": m.model, "name": m.model_alias, "host": s.host, "port": s.port,
                  "threads": m.n_threads, "interrupt_requests": s.interrupt_requests}))
""",
        "expect": {"model": VALUES["model_path"], "name": "smollm2", "host": "127.0.0.1", "port": 4242, "threads": 2,
                   "interrupt_requests": False},
    },
}


def templates(doc: str) -> dict:
    """Row label -> template, from the docs' table rows `| label | `cmd` | ...`."""
    out = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1].startswith("`") and cells[1].endswith("`"):
            out[cells[0]] = cells[1].strip("`")
    return out


# Finds each metric name (argv) in the installed package's Python sources.
METRICS = r"""
import importlib, json, pathlib, sys
root = pathlib.Path(importlib.import_module(sys.argv[1]).__file__).parent
text = "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))
missing = [m for m in sys.argv[2:]
           if '"%s"' % m not in text and not (m.endswith("_total") and '"%s"' % m[:-6] in text)]
print(json.dumps(missing))
"""


def metric_names(prefix: str) -> list:
    src = (ROOT / "crates" / "granary-agent" / "src" / "activity.rs").read_text()
    return sorted(set(re.findall(r'"(%s:[a-z_]+)"' % re.escape(prefix), src)))


def check_metrics(name: str, spec: dict, python: str) -> str:
    names = metric_names(spec["package"])
    if not names:
        return f"FAIL {name}: the agent reads no {spec['package']}: metric"
    r = subprocess.run([python, "-c", METRICS, spec["package"], *names], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return f"FAIL {name}: could not read its sources: {r.stderr.splitlines()[-1:]}"
    missing = json.loads(r.stdout.strip().splitlines()[-1])
    if missing:
        return f"FAIL {name}: metrics the agent reads that it does not declare: {missing}"
    return f"PASS {name}: declares the metrics the agent reads: {', '.join(names)}"


def render(template: str) -> list:
    line = re.sub(r"\{(\w+)\}", lambda m: shlex.quote(VALUES.get(m.group(1), m.group(0))), template)
    return shlex.split(line)


def check(name: str, spec: dict, template: str, python: str) -> str:
    argv = render(template)
    prefix = spec["prefix"]
    if argv[: len(prefix)] != prefix:
        return f"FAIL {name}: the template starts {argv[:len(prefix)]}, not {prefix}"
    # (vLLM's `serve` stays: it is the subcommand its parser knows.)
    args = argv[len(prefix):]
    r = subprocess.run([python, "-c", spec["parser"], *args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        err = [l for l in r.stderr.splitlines() if "error" in l.lower()][-3:] or r.stderr.splitlines()[-3:]
        return f"FAIL {name}: its parser refused {shlex.join(args)}: {' / '.join(err)}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got != spec["expect"]:
        return f"FAIL {name}: parsed {got}, expected {spec['expect']}"
    return f"PASS {name}: {shlex.join(prefix + args)} -> {got}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", help="the Python of a vLLM installation")
    ap.add_argument("--sglang", help="the Python of an SGLang installation")
    ap.add_argument("--llama-cpp", help="the Python of a llama-cpp-python installation with [server]")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "agent.md"))
    ap.add_argument("--require-all", action="store_true", help="a skipped engine is a failure")
    a = ap.parse_args()
    found = templates(pathlib.Path(a.doc).read_text())
    pythons = {"vllm": a.vllm, "sglang": a.sglang, "llama-cpp": a.llama_cpp}
    failed = False
    for name, spec in ENGINES.items():
        row = next((t for label, t in found.items() if spec["row"] in label), None)
        if row is None:
            print(f"FAIL {name}: no template row labelled {spec['row']!r} in {a.doc}")
            failed = True
            continue
        if not pythons[name]:
            print(f"skipped {name}: no interpreter given")
            failed |= a.require_all
            continue
        lines = [check(name, spec, row, pythons[name])]
        if spec["package"]:
            lines.append(check_metrics(name, spec, pythons[name]))
        for line in lines:
            print(line, flush=True)
            failed |= line.startswith("FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
