"""A generator of malformed task files, with a fixed seed.

Each file is a valid task (drawn at random from a pool of valid fields) with exactly ONE
defect injected: a wrong type, an out-of-range or non-finite number, a bad name, a hostile
path or URL (``s3://../x``, ``file:///etc``, unknown schemes, a bucket name its cloud refuses,
credentials in a URL), a value that a command line would read as an option, a YAML bomb, a loop of aliases, deep nesting, an unsupported tag, a merge key, a NUL or
other control character, unicode where only ASCII is allowed, a huge string, a broken file
structure, broken YAML syntax. Every defect makes the task invalid whatever the rest of it is,
so the right answer for every generated file is the same: exit 2, a one-paragraph error, no
traceback, nothing created. The valid bases themselves are checked separately (see
tests/unit/test_malformed_inputs.py), so a refusal is the defect's doing, not the base's.

Every field of the task has its own defects (:data:`BAD_VALUES`): top-level fields by name,
nested ones by dotted path (``resources.region``, ``train.module``, ``autostop.idle_minutes``,
``resources.ssh.hosts``, ``resources.aws.ssh_user`` ...), the defect put into an otherwise
valid mapping. :func:`field_paths` lists the task's fields, so a test can check that none is
left without one.

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
    if rng.random() < 0.2:
        t["stop_grace"] = rng.choice(["30", "60", "600.5"])
    if rng.random() < 0.2:
        t["autostop"] = rng.choice(["false", "true", _j({"idle_minutes": 30}),
                                    _j({"idle_minutes": 5, "down": False})])
    if rng.random() < 0.2:
        t["checkpoints"] = _j(rng.choice(GOOD_BUCKETS))
    if rng.random() < 0.15:
        t["recovery"] = rng.choice(["true", "false", _j({"max_recoveries": 2}),
                                    _j({"failover": False, "poll_seconds": 5})])
    if rng.random() < 0.15:
        mounts = json.loads(t.get("file_mounts", "{}"))
        mounts["ckpt-in"] = rng.choice(GOOD_BUCKETS)
        t["file_mounts"] = _j(mounts)
    return t


GOOD_BUCKETS = ["s3://my-bucket/run-1", "gs://my_bucket/ckpt", "s3://data.example.com/x/y",
                "https://acct1.blob.core.windows.net/ckpts/run-1"]


def render(t: dict[str, str]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in t.items())


# --- defects ---------------------------------------------------------------------------------

NON_FINITE = [".inf", "-.inf", ".nan", ".NaN", "+.inf", "1.0e400", "-1.0e400"]

# field -> invalid YAML values for it (each is invalid whatever the rest of the task is)
BAD_VALUES: dict[str, list[str]] = {
    # (SkyPilot's names, 'My-Job', 'job_1', 'job.1', are kept with a derived cluster name)
    "name": ["1job", "-job", "'" + "a" * 64 + "'", "jöb", "'ジョブ'", "'_job'",
             "'job name'", "''", "[a]", "{a: b}", "3", "'.job'", "'../x'", "'a/b'", "'*'",
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
                    "{? '" + "z/" * 2100 + "': ./data}", "[data]", "{data: [a]}",
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

# Bucket URLs each cloud refuses (its own naming rules) or that are no bucket URL at all.
BAD_BUCKET_URLS = [
    "s3://../x", "s3://./x", "s3://bucket/../x", "s3://bucket/a/./b", "s3://my-bucket//x",
    "gs://my-bucket/a//b", "s3://bucket//", "file:///etc", "file://localhost/etc/passwd",
    "ftp://host/x", "javascript://x", "unknown://bucket/x", "s3:///x", "s3://", "gs://",
    "s3://xn--abc/x", "s3://sthree-data/x", "s3://sthree-configurator/x", "s3://amzn-s3-demo-x",
    "s3://data-s3alias/x", "s3://data--ol-s3/x", "s3://data.mrap/x", "s3://data--x-s3/x",
    "s3://data--table-s3/x", "s3://192.168.5.4/x", "s3://My-Bucket/x", "s3://my_bucket/x",
    "s3://ab", "s3://" + "a" * 64, "s3://a..b/x", "s3://-bucket/x", "s3://bucket-/x",
    "gs://goog-data/x", "gs://googbucket", "gs://my-google-data/x", "gs://my-g00gle/x",
    "gs://googl3-x", "gs://" + "g" * 64, "gs://" + "a" * 64 + ".example.com",
    "gs://10.0.0.1/x", "gs://a..b", "gs://-x/y", "gs://x_/y",
    "https://acct1.blob.core.windows.net/a--b/x", "https://acct1.blob.core.windows.net/AB/x",
    "https://acct1.blob.core.windows.net//c1/x", "https://acct1.blob.core.windows.net/",
    "https://ACCT.blob.core.windows.net/c1/x", "https://evil.example.com/c1/x",
    "https://x.blob.core.windows.net/c1/x", "http://10.0.0.5:10000/acct1/c1/x",
    "http://127.0.0.1/acct1/c1/x", "http://127.0.0.1:10000/A/c1/x", "az://acct1/c1/x",
    "s3://AKIAKEY:SECRET@bucket/x", "gs://user@bucket/x", "s3://bucket/x?versionId=1",
    "https://acct1.blob.core.windows.net/c1/x?sig=abc", "s3://bucket/x#frag",
    "s3://bucket/a\\b", "s3://bucket/" + "p" * 1100,
]
_URL_VALUES = [_j(u) for u in BAD_BUCKET_URLS]

# Values a command line would read as an option, or that carry a newline into a config file.
HOSTILE_WORDS = ["-oProxyCommand=touch /tmp/ct-pwned", "--help", "-x", "a\nb", "a b\tc",
                 "", "x" * 300]

BAD_VALUES.update({
    "file_mounts": BAD_VALUES["file_mounts"] + [f"{{data: {u}}}" for u in _URL_VALUES],
    "checkpoints": _URL_VALUES + ["5", "[s3://b/x]", "{a: b}", "true", "''", "not-a-url",
                                  "./local/dir", "/abs/dir"],
    "stop_grace": ["0", "-1", "3601", "1.0e9", "'soon'", "[1]", "{a: 1}", "null", "''",
                   *NON_FINITE],
    "autostop": ["'sometimes'", "5", "[5]", "'true'", "{idle_minutes: 5, idle: 3}",
                 "{idel_minutes: 5}"],
    "autostop.idle_minutes": ["0", "-5", "1.0e9", "'soon'", "[1]", "{a: 1}", *NON_FINITE],
    "autostop.down": ["perhaps", "[true]", "{a: 1}", "2", "'sometimes'"],
    "recovery": ["'maybe'", "5", "[true]", "{max_recoveres: 3}", "''"],
    "recovery.max_recoveries": ["-1", "101", "1.5", "'many'", "[1]", "null", *NON_FINITE],
    "recovery.failover": ["perhaps", "[1]", "3", "'sometimes'"],
    "recovery.poll_seconds": ["0", "0.1", "601", "-1", "'often'", "[1]", *NON_FINITE],
    "resources.provider": ["nowhere", "[local]", "5", _j("-oProxyCommand=x"), "LOCAL"],
    "resources.region": [_j(w) for w in HOSTILE_WORDS] + ["[us-east-1]", "5", "{a: b}",
                                                          _j("../x"), _j("us east 1")],
    "resources.zone": [_j(w) for w in HOSTILE_WORDS] + ["[a]", "7", _j("us-east-1a;rm")],
    "resources.instance_type": [_j(w) for w in HOSTILE_WORDS] + ["[p4d]", "5",
                                                                 _j("p4d.24xlarge x")],
    "resources.image": [_j(w) for w in ("-oProxyCommand=x", "", "a\nb", "x" * 1100, "\t")]
                       + ["[ami-1]", "5"],
    "resources.accelerators": ["'A100:x'", "'A100:0'", "'A100:65'", "':4'", "{A100: .inf}",
                               "{A100: -1}", "{A100: 1, H100: 2}", "{name: A100, count: 0}",
                               "{name: A100, cnt: 1}", "5", "[A100]", _j("-x:8"),
                               _j("A1\u000700:8"), _j("x" * 100 + ":8"), "'A100:1.5'"],
    "resources.use_spot": ["perhaps", "[true]", "{a: 1}", "2", "'sometimes'"],
    "resources.disk_size_gb": ["7", "70000", "-1", "1.5", "'big'", "[8]", *NON_FINITE],
    "resources.ports": ["[22]", "[0]", "[70000]", "[-1]", "[.nan]", "[.inf]", "8080",
                        "[http]", "[[1]]", "[1.5]"],
    "resources.ssh_cidr": ["not-a-cidr", "'10.0.0.0/33'", "[1]", "5", "'-oX'", "''"],
    "resources.network": ["faster", "FAST", "[fast]", "5", "true", "''"],
    "resources.ssh_proxy": [_j(w) for w in HOSTILE_WORDS]
                           + [_j(w) for w in ("bastion:0", "bastion:70000", "u@", "@bastion",
                                              "a@b@c", "bastion,", ",bastion", "[::1", "[x]:22",
                                              "nc host port", "nc %h 22", "-W %h:%p bastion",
                                              "ssh -W %h:%p b\x07", "b;rm -rf ~", "-oProxyCommand",
                                              "bastion:22:22", "x" * 1100 + " %h %p")]
                           + ["5", "[bastion]", "{host: b}", "true"],
    "resources.max_hourly_cost": ["0", "-1", "1.0e9", "'cheap'", "[1]", *NON_FINITE],
    "resources.gpus_per_job": ["0", "-1", "65", "1.5", "'one'", "[1]", *NON_FINITE],
    "resources.cpus": ["0", "-1", "'4++'", "'4GB'", "'many'", "[4]", "true", "5000", *NON_FINITE],
    "resources.memory": ["0", "'-32+'", "'32TB'", "'lots'", "[32]", "70000", *NON_FINITE],
    "resources.local.network": ["netns2", "[loopback]", "5", "''"],
    "resources.local.python": ["relative/python", "5", _j("/" + "p/" * 2500),
                               _j("/usr/bin/py\nthon"), "''"],
    "resources.local.price_per_hour": ["-1", "1.0e9", "'free'", "[1]", *NON_FINITE],
    "resources.local.gpus": ["0", "-1", "65", "1.5", "'two'", "[2]", *NON_FINITE],
    "resources.local.typo": ["1"],
    "resources.ssh.hosts": ["[]", "5", "[5]", "[[h1]]", _j(["-oProxyCommand=touch x"]),
                            _j(["u@-oProxyCommand=x"]), _j(["-x@h1"]), _j(["h1:port"]),
                            _j(["h1:70000"]), _j([{"address": "--", "user": "u"}]),
                            _j([{"address": "h1", "user": "-oX=y"}]),
                            _j([{"address": "h1", "internal_ip": "-oX"}]),
                            _j([{"address": "h1", "internal_ip": "a\nb"}]),
                            _j([{"address": "h1", "port": 0}]),
                            _j([{"address": "h1", "port": 1.0e400}]),
                            _j([{"address": "h1", "identity_file": "-oX"}]),
                            _j([{"address": "h1", "identity_file": "k\ney"}]),
                            _j([{"address": "h 1"}]), _j([{"address": ""}]),
                            _j([{"address": "h1", "adress": "h2"}])],
    "resources.aws.efa": ["maybe", "[1]", "2"],
    "resources.aws.ssh_user": [_j(w) for w in ("-oX=y", "ubuntu\n", "Ubuntu", "a b", "")],
    "resources.aws.vpc_id": [_j("sg-1"), "5", "[vpc-1]"],
    "resources.aws.subnet_ids": [_j(["x-1"]), _j("subnet-1"), "5"],
    "resources.aws.spot_max_price": ["0", "-1", "'cheap'", "'inf'", "'nan'", *NON_FINITE],
    "resources.aws.host_key_wait": ["-1", "901", "'soon'", *NON_FINITE],
    "resources.aws.vpcid": ["vpc-1"],
    "resources.gcp.ssh_user": [_j(w) for w in ("-oX=y", "root\n", "A", "")],
    "resources.gcp.public_ip": ["perhaps", "[1]"],
    "resources.gcp.host_key_wait": ["-1", "'soon'", *NON_FINITE],
    "resources.gcp.projcet": ["x"],
    "resources.azure.ssh_user": [_j(w) for w in ("-oX=y", "root", "azureuser\n", "")],
    "resources.azure.vnet_cidr": [_j("8.8.8.0/24"), _j("10.0.0.0/28"), "5", _j("x")],
    "resources.azure.spot_max_price": ["-2", "'cheap'", *NON_FINITE],
    "resources.azure.sizes": ["[a]"],
    **{f"resources.aws.{f}": ["perhaps", "[1]", "{a: 1}"]
       for f in ("placement_group", "public_ip", "inject_host_key")},
    "resources.aws.iam_instance_profile": ["5", "[x]", "{a: 1}"],
    **{f"resources.gcp.{f}": ["5", "[x]", "{a: 1}"]
       for f in ("project", "credentials_file", "network", "subnetwork", "image_project",
                 "image_family", "disk_type", "service_account")},
    **{f"resources.{c}.{f}": ["5", "{a: 1}", "[[x]]"]
       for c in ("gcp", "azure") for f in ("regions", "zones")},
    "resources.gcp.install_nvidia_driver": ["perhaps", "[1]"],
    "resources.azure.subscription_id": ["5", "[x]", "{a: 1}"],
    **{f"resources.azure.{f}": ["perhaps", "[1]", "{a: 1}"]
       for f in ("public_ip", "accelerated_networking", "self_stop")},
    "train.script": [_j("/etc/passwd"), _j("../train.py"), _j("-c"), _j("~/train.py"), "5",
                     "[train.py]", _j("s" * 300), _j("")],
    "train.module": [_j("-cimport os"), _j("os;rm"), _j("a..b"), _j("1mod"), _j(""), "5",
                     "[m]", _j("m" * 200)],
    "train.args": ["5", "[[1]]", "[{a: 1}]", "'--lr 1'", "{a: b}"],
    "train.nproc_per_node": ["0", "65", "-1", "many", "1.5", "[1]", *NON_FINITE],
    "train.rendezvous": ["etcd", "[static]", "5", "STATIC"],
    "train.max_restarts": ["-1", "101", "1.5", "'x'", *NON_FINITE],
    "train.master_port": ["80", "1023", "70000", "-1", "'port'", *NON_FINITE],
    "bootstrap.python": ["relative/python", _j("/" + "p" * 300), _j("/" + "p/" * 2500 + "py"),
                         _j("/usr/bin/py\nthon"), "5", "[/usr/bin/python3]", "''"],
    "bootstrap.torch": ["numpy", _j("torch; rm -rf /"), _j("torch==x"), "5", "[torch]"],
    "bootstrap.torch_index": ["'ftp://x'", "'file:///etc'", "'https://a b'", "5", "''"],
    "bootstrap.cuda_toolkit": ["perhaps", "[true]", "2"],
    "container": ["'ubuntu'", "5", "[ubuntu]", "{}", "{image: ubuntu, pull: always}"],
    "container.image": [_j("Ubuntu:24.04"), _j("-oProxyCommand=x"), _j("a b"), _j("x:tag:tag"),
                        _j("repo@sha256:12"), _j(""), "5", "[ubuntu]", _j("r/" * 200 + "x"),
                        _j("ubuntu\n")],
    "container.registry_auth": ["'NGC_KEY'", "{username_env: NGC_USER}", "[NGC_USER, NGC_KEY]",
                                "{username_env: 'my secret', password_env: NGC_KEY}",
                                "{username_env: U, password_env: P, server: x}"],
    "container.run_options": [_j(["--privileged"]), _j(["--network=bridge"]), _j(["--pid", "host"]),
                              _j(["-v", "/var/run/docker.sock:/s"]), _j(["--cap-add=SYS_ADMIN"]),
                              _j(["--shm-size"]), _j(["--foo"]), "'--ipc=host'", "[5]",
                              _j(["--security-opt", "seccomp=unconfined"]), _j(["-u", "0"])],
    "container.privileged": ["perhaps", "[true]", "2"],
    "container.keep_image": ["perhaps", "[true]", "2"],
})

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


# What a provider's options need besides the defect, so the defect is the only fault.
_PROVIDER_BASE: dict[str, dict[str, object]] = {
    "local": {"provider": "local"},
    "ssh": {"provider": "ssh"},
    "aws": {"provider": "aws", "accelerators": "A100:8"},
    "gcp": {"provider": "gcp", "accelerators": "A100:8"},
    "azure": {"provider": "azure", "accelerators": "A100:8"},
}


def _nested(top: str, base_text: str | None, sub: str, value: str) -> str:
    """The flow mapping of ``top`` (its base value, when it has one, else the least that is
    valid) with ``sub`` set to the raw YAML ``value``: ``resources.region``,
    ``train.module``, or a provider's option ``resources.<provider>.<option>``."""
    base: dict[str, object] = {}
    if base_text and base_text.startswith("{"):
        base = json.loads(base_text)
    if top == "train":
        base = {k: v for k, v in base.items() if k != "script"} if sub == "script" else base
        if sub == "module":
            base.pop("script", None)
        elif sub != "script":
            base.setdefault("script", "train.py")
    if top == "container" and sub != "image":
        base.setdefault("image", "ubuntu:24.04")   # the one field the section needs
    key, _, option = sub.partition(".")
    if option:                      # resources.<provider>.<option>
        base = dict(_PROVIDER_BASE[key])
        inner = {"hosts": ["h1"]} if key == "ssh" and option != "hosts" else {}
        value = "{" + ", ".join([*(f"{k}: {_j(v)}" for k, v in inner.items()),
                                 f"{option}: {value}"]) + "}"
    base.pop(key, None)
    return "{" + ", ".join([*(f"{k}: {_j(v)}" for k, v in base.items()), f"{key}: {value}"]) + "}"


def field_paths() -> list[str]:
    """Every field of a task, by dotted path: the top level, the nested models' fields, and
    the options of the providers installed with cloudtrain."""
    from cloudtrain.containers.spec import ContainerSpec
    from cloudtrain.taskmodel import Autostop, BootstrapSpec, Recovery, Resources, Task, Train

    out = [f for f in Task.model_fields if f != "base_dir"]
    for top, model in (("resources", Resources), ("train", Train), ("bootstrap", BootstrapSpec),
                       ("autostop", Autostop), ("recovery", Recovery),
                       ("container", ContainerSpec)):
        out += [f"{top}.{f}" for f in model.model_fields]
    from cloudtrain.provider import registry

    for name in ("local", "ssh", "aws", "gcp", "azure"):
        model = getattr(registry.provider_class(name), "options_model", None)
        out += [f"resources.{name}.{f}" for f in (model.model_fields if model else {})]
    return out


def _bad_value(base: dict[str, str], field: str, value: str) -> tuple[str, str]:
    """``base`` with ``field`` (a top-level name or a dotted path) set to ``value``."""
    t = dict(base)
    top, _, sub = field.partition(".")
    if top == "train":
        t.pop("run", None)
    if top == "run":
        t.pop("train", None)
    t[top] = _nested(top, t.get(top), sub, value) if sub else value
    return f"bad-value:{field}", render(t)


def _defect(rng: random.Random, base: dict[str, str]) -> tuple[str, str]:
    """One defective file from a valid base: (defect kind, text)."""
    kind = rng.choices(
        ["bad-value", "unknown-field", "bomb", "deep", "loop", "tag", "tag-directive", "merge",
         "control-char", "quoted-nul", "huge-file", "structural", "syntax"],
        weights=[40, 6, 5, 5, 3, 6, 2, 3, 6, 3, 2, 8, 8])[0]
    t = dict(base)
    if kind == "bad-value":
        field = rng.choice(list(BAD_VALUES))
        return _bad_value(t, field, rng.choice(BAD_VALUES[field]))
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


COUNT = 1800


def generate(n: int = COUNT, seed: int = SEED) -> list[Malformed]:
    """``n`` distinct malformed task files, the same ones for the same seed: first every bad
    value of :data:`BAD_VALUES` once (each on a base drawn at random), then defects of every
    kind drawn at random."""
    rng = random.Random(seed)
    out: list[Malformed] = []
    seen: set[str] = set()
    every = [(f, v) for f, values in BAD_VALUES.items() for v in values]
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > n * 50:
            raise RuntimeError(f"only {len(out)} distinct files after {attempts} attempts")
        if every:
            kind, text = _bad_value(valid_base(rng), *every.pop(0))
        else:
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
