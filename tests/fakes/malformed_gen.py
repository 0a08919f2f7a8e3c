"""A generator of malformed task files, with a fixed seed.

Each file is a valid task (drawn at random from a pool of valid fields) with exactly ONE
defect injected: a wrong type, an out-of-range or non-finite number, a bad name, a hostile
path, a YAML bomb, a loop of aliases, deep nesting, an unsupported tag, a merge key, a NUL or
other control character, unicode where only ASCII is allowed, a huge string, a broken file
structure, broken YAML syntax. Every defect makes the task invalid whatever the rest of it is,
so the right answer for every generated file is the same: exit 2, a one-paragraph error, no
traceback, nothing created. The valid bases themselves are checked separately (see
tests/unit/test_malformed_inputs.py), so a refusal is the defect's doing, not the base's.

Files are expected to live in a project directory made by :func:`make_project`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 20261123

# Limits of cloudtrain/yamlsrc.py that the bombs and nestings must exceed.
_MAX_NODES = 20_000
_MAX_DEPTH = 32
_MAX_BYTES = 256 * 1024


@dataclass(frozen=True)
class Malformed:
    id: str
    text: str
    defect: str
    """The kind of defect (for reports and per-kind sampling)."""


def make_project(root: Path, outside: Path) -> Path:
    """The directory the generated files are written to (their workdir '.'): a script, a data
    directory, a config file, and a link to a directory outside it (``outside``)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "train.py").write_text("print('train')\n")
    (root / "data").mkdir(exist_ok=True)
    (root / "data" / "x.txt").write_text("x\n")
    (root / "cfg.json").write_text("{}\n")
    outside.mkdir(parents=True, exist_ok=True)
    link = root / "lnk"
    if not link.is_symlink():
        link.symlink_to(outside, target_is_directory=True)
    return root


# --- valid bases ---------------------------------------------------------------------------

def _j(v: object) -> str:
    """A value as YAML flow text (JSON is valid YAML flow)."""
    return json.dumps(v, ensure_ascii=False)


def valid_base(rng: random.Random) -> dict[str, str]:
    """Top-level key -> YAML text of its value, in file order. Always a valid task."""
    t: dict[str, str] = {}
    if rng.random() < 0.8:
        t["name"] = _j(rng.choice(["job", "my-job", "a", "train-1", "exp-42", f"run{rng.randint(0, 999)}"]))
    t["num_nodes"] = str(rng.randint(1, 4))
    if rng.random() < 0.7:
        res: dict[str, object] = {"provider": "local"}
        if rng.random() < 0.3:
            res["disk_size_gb"] = rng.choice([8, 50, 200])
        if rng.random() < 0.3:
            res["ports"] = [rng.choice([6006, 8080, 29400])]
        t["resources"] = _j(res)
    t["workdir"] = _j(".")
    if rng.random() < 0.5:
        t["file_mounts"] = _j(rng.choice([{"inputs": "./data"}, {"conf/cfg.json": "./cfg.json"},
                                          {"d": "data"}]))
    if rng.random() < 0.6:
        t["envs"] = _j(rng.choice([{"LR": "0.1"}, {"N": 3}, {"A_B": True, "C": None}]))
    if rng.random() < 0.4:
        t["setup"] = _j(rng.choice(["echo setup", "pip list | head -n 3"]))
    if rng.random() < 0.5:
        t["train"] = _j({"script": "train.py", "args": rng.choice([[], ["--lr", "0.1"], ["--n", "3"]])})
    else:
        t["run"] = _j(rng.choice(["echo hi", "python train.py", "nvidia-smi || true"]))
    if rng.random() < 0.4:
        t["outputs"] = _j(["out/"])
    if rng.random() < 0.3:
        t["max_hours"] = rng.choice(["1.5", "2", "0.25"])
    if rng.random() < 0.3:
        t["max_cost_usd"] = rng.choice(["3", "10.5"])
    return t


def render(t: dict[str, str]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in t.items())


# --- defects ---------------------------------------------------------------------------------

NON_FINITE = [".inf", "-.inf", ".nan", ".NaN", "+.inf", "1.0e400", "-1.0e400"]

# field -> invalid YAML values for it (each is invalid whatever the rest of the task is)
BAD_VALUES: dict[str, list[str]] = {
    "name": ["My-Job", "job_1", "1job", "-job", "job-", "'" + "a" * 41 + "'", "jöb", "'ジョブ'",
             "'job name'", "''", "[a]", "{a: b}", "3", "'job.1'", "'../x'", "'a/b'", "'*'",
             "'" + "x" * 10_000 + "'", "'🚀'", "'ｊｏｂ'"],
    "num_nodes": ["0", "-1", "513", "1000000000000000000000", "two", "1.5", "[1]", "{a: 1}",
                  "null", "'3x'", "''", *NON_FINITE],
    "workdir": ["does-not-exist", "/nonexistent/dir/xyz", "'" + "a" * 5000 + "'",
                "'" + "a/" * 2100 + "'", "'" + "b" * 300 + "'", "\"a\\0b\"", "[.]", "5",
                "{a: b}", "train.py"],
    "file_mounts": ["{../x: ./data}", "{a/../../x: ./data}", "{'..': ./data}", "{~/x: ./data}",
                    "{'~root/x': ./data}", "{.: ./data}", "{./: ./data}", "{'': ./data}",
                    "{data: ./missing}", "{lnk/x: ./data}", "{lnk/sub/x: ./cfg.json}",
                    "{x: '" + "a" * 300 + "'}", "{'" + "y" * 300 + "': ./data}",
                    "{'" + "z/" * 2100 + "': ./data}", "[data]", "{data: [a]}",
                    "{data: \"./da\\0ta\"}", "{\"a\\0b\": ./data}", "{data: {a: b}}", "5"],
    "envs": ["{1BAD: x}", "{'A-B': x}", "{'': x}", "{'ÄB': x}", "{'A B': x}", "[A]",
             "{A: [1]}", "{A: {b: 1}}", "{A: \"x\\0y\"}", "{'ＡＢ': x}", "5", "'A=1'"],
    "setup": ["[1, 2]", "{a: 1}", "5", "\"echo \\0 hi\""],
    "run": ["[1, 2]", "{a: 1}", "5", "\"echo \\0 hi\"", "true"],
    "train": ["{script: train.py, module: m}", "{}", "{script: missing.py}",
              "{script: train.py, nproc_per_node: 0}", "{script: train.py, nproc_per_node: 65}",
              "{script: train.py, nproc_per_node: many}", "{script: train.py, rendezvous: etcd}",
              "{script: train.py, max_restarts: -1}", "{script: train.py, max_restarts: 101}",
              "{script: train.py, master_port: 80}", "{script: train.py, master_port: 70000}",
              "{script: train.py, args: 5}", "{script: train.py, args: [[1]]}",
              "{script: train.py, args: [{a: 1}]}", "{scrpit: train.py}",
              "{script: train.py, nproc_per_node: .inf}", "{script: train.py, master_port: .nan}",
              "{script: train.py, max_restarts: .inf}", "{script: train.py, args: [\"a\\0\"]}",
              "{script: '" + "s" * 300 + "'}", "[train.py]", "train.py"],
    "resources": ["[a]", "5", "{provider: nowhere}", "{disk_size_gb: 7}",
                  "{disk_size_gb: 70000}", "{disk_size_gb: .inf}", "{ports: [22]}",
                  "{ports: [0]}", "{ports: [70000]}", "{ports: [.nan]}", "{ssh_cidr: not-a-cidr}",
                  "{accelerators: 'A100:x'}", "{accelerators: 'A100:0'}",
                  "{accelerators: 'A100:65'}", "{accelerators: ':4'}",
                  "{accelerators: {A100: .inf}}", "{max_hourly_cost: .inf}",
                  "{max_hourly_cost: -1}", "{max_hourly_cost: 1.0e9}", "{max_hourly_cost: .nan}",
                  "{use_spot: perhaps}", "{provider: local, aws: {}}", "{regoin: x}",
                  "{provider: [local]}"],
    "bootstrap": ["{torch: numpy}", "{python: relative/python}", "{torch_index: 'ftp://x'}",
                  "{cuda_toolkit: perhaps}", "{pyhton: /x}", "[torch]"],
    "outputs": ["[/abs]", "[../x]", "out", "[[a]]", "[a/../../b]", "['" + "o" * 300 + "']"],
    "outputs_from": ["some", "[head]", "HEAD"],
    "outputs_dir": ["'" + "a" * 5000 + "'", "[x]", "'" + "d" * 300 + "'"],
    "max_hours": ["0", "-1", "1.0e9", "9000", "'soon'", "[1]", *NON_FINITE],
    "max_cost_usd": ["0", "-5", "1.0e8", "'lots'", "{a: 1}", *NON_FINITE],
}

UNKNOWN_KEYS = ["num_node", "nmae", "resorces", "wrokdir", "envz", "setpu", "rnu", "outptus",
                "max_hour", "bootsrap", "file_mount", "näme", "名前", "🚀", "Name", "NUM_NODES",
                "x" * 200]

TAGGED = ["!!int abc", "!!int 1.5", "!!bool maybe", "!!timestamp 2001-13-45",
          "!!timestamp 2001-12-14", "!custom x", "!!set {a, b}", "!!binary aGVsbG8=",
          "!!python/object:os.system x", "!!omap [a: 1]", "!!pairs [a: 1]", "!!seq abc",
          "!!map abc", "!!float abc", "!<tag:example.com,2000:x> y", "!!python/name:os.system ''"]

CONTROL_CHARS = [chr(c) for c in (*range(0, 9), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F)] + [
    "\ufffe", "\uffff"]


def _bomb(rng: random.Random) -> str:
    while True:
        width, levels = rng.randint(3, 12), rng.randint(3, 9)
        if width ** levels > _MAX_NODES * 2:
            break
    lines = ["x0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels + 1):
        lines.append(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def _deep(rng: random.Random) -> str:
    depth = rng.choice([_MAX_DEPTH + 1, _MAX_DEPTH + 5, 100, 500, 1000, 3000])
    style = rng.choice(["flow-list", "flow-map", "block"])
    if style == "flow-list":
        return "envs: " + "[" * depth + "]" * depth + "\n"
    if style == "flow-map":
        return "envs: " + "{a: " * depth + "1" + "}" * depth + "\n"
    return "envs:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(depth)) \
        + "  " * (depth + 1) + "v\n"


def _loop(rng: random.Random) -> str:
    return rng.choice(["envs: &a [*a]\n", "resources: &r {provider: *r}\n",
                       "envs: &a {A: [1, {b: *a}]}\n", "train: &t [&u [*t]]\n",
                       "file_mounts: &m {x: *m}\n"])


def _merge(rng: random.Random) -> str:
    return rng.choice(["envs: &e {A: '1'}\nresources:\n  <<: {provider: local}\n",
                       "resources: &r {provider: local}\nbootstrap:\n  <<: *r\n",
                       "envs:\n  <<: [{A: '1'}, {B: '2'}]\n"])


def _quoted_nul(rng: random.Random) -> str:
    key = rng.choice(["name", "setup", "workdir", "outputs_dir"])
    escape = rng.choice(["\\0", "\\x00", "\\u0000"])
    return f'{key}: "a{escape}b"\n'


def _structural(rng: random.Random, base: dict[str, str]) -> tuple[str, str]:
    kind = rng.choice(["top-list", "top-scalar", "empty", "comments-only", "two-documents",
                       "duplicate-key", "run-and-train", "neither", "blank-lines"])
    text = render(base)
    if kind == "top-list":
        return kind, "".join(f"- {k}: {v}\n" for k, v in base.items())
    if kind == "top-scalar":
        return kind, rng.choice(["just a string\n", "42\n", "null\n", "~\n", "'x'\n", "[]\n", "{}\n"])
    if kind == "empty":
        return kind, ""
    if kind == "comments-only":
        return kind, "# a task\n# " + rng.choice(["nothing", "name: x"]) + "\n"
    if kind == "blank-lines":
        return kind, "\n" * rng.randint(1, 50)
    if kind == "two-documents":
        return kind, text + "---\n" + text
    if kind == "duplicate-key":
        k = rng.choice(list(base))
        return kind, text + f"{k}: {base[k]}\n"
    if kind == "run-and-train":
        base = dict(base)
        base["run"] = _j("echo hi")
        base["train"] = _j({"script": "train.py"})
        return kind, render(base)
    base = {k: v for k, v in base.items() if k not in ("run", "train")}
    return kind, render(base)


def _syntax(rng: random.Random, base: dict[str, str]) -> tuple[str, str]:
    kind = rng.choice(["unclosed-list", "unclosed-map", "unclosed-quote", "bad-indent", "tab-indent",
                       "undefined-tag-handle", "undefined-alias", "duplicate-anchor", "bad-directive"])
    text = render(base)
    if kind == "unclosed-list":
        return kind, text + f"outputs: [out/, {rng.choice(['a', 'b/'])}\n"
    if kind == "unclosed-map":
        return kind, text.replace("num_nodes: ", "num_nodes: {a: ", 1)
    if kind == "unclosed-quote":
        return kind, text + rng.choice(["setup: \"echo hi\n", "setup: 'echo hi\n"])
    if kind == "bad-indent":
        k = rng.choice([k for k in base if not base[k].startswith(("{", "["))] or ["num_nodes"])
        return kind, text.replace(f"{k}: {base.get(k, '')}\n", f"{k}: {base.get(k, '')}\n  x: 1\n", 1)
    if kind == "tab-indent":
        return kind, text + "bootstrap:\n\ttorch: torch\n"
    if kind == "undefined-tag-handle":
        return kind, text + "setup: !e!x y\n"
    if kind == "undefined-alias":
        return kind, text + f"setup: *{rng.choice(['nope', 'a1', 'x'])}\n"
    if kind == "duplicate-anchor":
        return kind, text + "envs: {A: &a '1', B: &a '2'}\n"
    return kind, "%YAML 9.9\n---\n" + text


def _defect(rng: random.Random, base: dict[str, str]) -> tuple[str, str]:
    """One defective file from a valid base: (defect kind, text)."""
    kind = rng.choices(
        ["bad-value", "unknown-field", "bomb", "deep", "loop", "tag", "tag-directive", "merge",
         "control-char", "quoted-nul", "huge-file", "structural", "syntax"],
        weights=[40, 6, 5, 5, 3, 6, 2, 3, 6, 3, 2, 8, 8])[0]
    t = dict(base)
    if kind == "bad-value":
        field = rng.choice(list(BAD_VALUES))
        value = rng.choice(BAD_VALUES[field])
        if field == "train":
            t.pop("run", None)
        if field == "run":
            t.pop("train", None)
        t[field] = value
        return f"bad-value:{field}", render(t)
    if kind == "unknown-field":
        t[rng.choice(UNKNOWN_KEYS)] = _j(rng.choice(["x", 1, [1], {"a": 1}]))
        return kind, render(t)
    if kind == "bomb":
        return kind, render(t) + _bomb(rng)
    if kind == "deep":
        t.pop("envs", None)
        return kind, render(t) + _deep(rng)
    if kind == "loop":
        text = _loop(rng)
        for k in ("envs", "resources", "train", "file_mounts"):
            if text.startswith(k + ":"):
                t.pop(k, None)
        return kind, render(t) + text
    if kind == "tag":
        field = rng.choice(["name", "num_nodes", "setup", "workdir", "max_hours", "envs"])
        t[field] = rng.choice(TAGGED)
        return kind, render(t)
    if kind == "tag-directive":
        t["setup"] = "!e!" + rng.choice(["foo", "bar"]) + " x"
        return kind, "%TAG !e! tag:example.com,2000:\n---\n" + render(t)
    if kind == "merge":
        text = _merge(rng)
        for k in ("envs", "resources", "bootstrap"):
            t.pop(k, None)
        return kind, render(t) + text
    if kind == "control-char":
        text = render(t)
        at = rng.randint(0, len(text))
        return kind, text[:at] + rng.choice(CONTROL_CHARS) + text[at:]
    if kind == "quoted-nul":
        text = _quoted_nul(rng)
        t.pop(text.split(":", 1)[0], None)
        return kind, render(t) + text
    if kind == "huge-file":
        size = _MAX_BYTES + rng.randint(1, 200_000)
        if rng.random() < 0.5:
            return kind, render(t) + "# " + "x" * size + "\n"
        t.pop("train", None)
        t["run"] = _j("echo " + "y" * size)
        return kind, render(t)
    if kind == "structural":
        sub, text = _structural(rng, t)
        return f"structural:{sub}", text
    sub, text = _syntax(rng, t)
    return f"syntax:{sub}", text


def generate(n: int = 1200, seed: int = SEED) -> list[Malformed]:
    """``n`` distinct malformed task files, the same ones for the same seed."""
    rng = random.Random(seed)
    out: list[Malformed] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > n * 50:
            raise RuntimeError(f"only {len(out)} distinct files after {attempts} attempts")
        kind, text = _defect(rng, valid_base(rng))
        if text in seen:
            continue
        seen.add(text)
        out.append(Malformed(f"{len(out):04d}-{kind}", text, kind))
    return out


def bases(n: int = 200, seed: int = SEED) -> list[str]:
    """Valid task files from the same pool the defects start from."""
    rng = random.Random(seed + 1)
    return [render(valid_base(rng)) for _ in range(n)]
