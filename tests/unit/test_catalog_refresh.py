"""``cloudtrain catalog refresh`` against fixture responses in each source's real format
(tests/fixtures/prices/), served by a loopback HTTP server:

* AWS: the bulk price list (region_index.json + two region files) and DescribeSpotPriceHistory
  (EC2 Query API XML, two pages) answered to a real boto3 client (``AWS_ENDPOINT_URL_EC2``
  points it at the server; dummy credentials);
* Azure: the Retail Prices API, two pages joined by NextPageLink;
* GCP: the Cloud Billing Catalog API, two pages joined by nextPageToken.

Nothing leaves 127.0.0.1. The CLI runs in a subprocess with its own $CLOUDTRAIN_HOME.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cloudtrain.catalog import store
from cloudtrain.catalog.model import CatalogInfo, Offer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "prices"
API_KEY = "test-key-123"
SPOT_TOKEN = "eyJ2IjoiMiIsImMiOiJwYWdlMiJ9"


# --- the fixture server ------------------------------------------------------------------------

class PriceServer:
    """Serves tests/fixtures/prices like the three clouds would. ``fail[path] = [500, ...]``
    answers those statuses first; ``hang`` paths never answer in time."""

    def __init__(self) -> None:
        self.requests: list[dict[str, object]] = []
        self.fail: dict[str, list[int]] = {}
        self.hang: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server._handle(self, b"")

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                server._handle(self, self.rfile.read(n))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> PriceServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def paths(self, prefix: str) -> list[str]:
        return [str(r["path"]) for r in self.requests if str(r["path"]).startswith(prefix)]

    def _handle(self, h: BaseHTTPRequestHandler, body: bytes) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = urllib.parse.parse_qs(url.query)
        with self._lock:
            self.requests.append({"method": h.command, "path": url.path, "query": query,
                                  "headers": dict(h.headers), "body": body})
            queued = self.fail.get(url.path)
            status = queued.pop(0) if queued else None
        if url.path in self.hang:
            time.sleep(3)
            return
        if status is not None:
            return self._send(h, status, b'{"error": {"code": %d, "message": "backend error"}}'
                              % status, "application/json")
        if url.path.startswith("/offers/"):
            f = FIXTURES / "aws" / url.path.lstrip("/")
            if not f.is_file():
                return self._send(h, 404, b"<Error><Code>NoSuchKey</Code></Error>", "text/xml")
            return self._send(h, 200, f.read_bytes(), "application/json")
        if url.path == "/api/retail/prices":
            page = "prices-page2.json" if "$skip" in query else "prices-page1.json"
            text = (FIXTURES / "azure" / page).read_text()
            text = text.replace("https://prices.azure.com:443", self.base)
            return self._send(h, 200, text.encode(), "application/json")
        if url.path == "/v1/services/6F81-5844-456A/skus":
            if h.headers.get("X-Goog-Api-Key") != API_KEY:
                return self._send(h, 400, json.dumps({"error": {
                    "code": 400, "message": "API key not valid. Please pass a valid API key.",
                    "status": "INVALID_ARGUMENT"}}).encode(), "application/json")
            page = "skus-page2.json" if query.get("pageToken") else "skus-page1.json"
            return self._send(h, 200, (FIXTURES / "gcp" / page).read_bytes(), "application/json")
        if url.path.startswith("/ec2"):
            form = urllib.parse.parse_qs(body.decode())
            assert form["Action"] == ["DescribeSpotPriceHistory"], form
            auth = h.headers.get("Authorization", "")
            region = auth.split("Credential=", 1)[1].split("/")[2] if "Credential=" in auth else ""
            token = form.get("NextToken", [""])[0]
            f = FIXTURES / "aws" / "spot" / (f"{region}.{token}.xml" if token else f"{region}.xml")
            if not f.is_file():
                f = FIXTURES / "aws" / "spot" / "eu-west-1.xml"
                data = f.read_text().split("<spotPriceHistorySet>")[0] + \
                    "<spotPriceHistorySet/>\n    <nextToken/>\n</DescribeSpotPriceHistoryResponse>\n"
                return self._send(h, 200, data.encode(), "text/xml;charset=UTF-8")
            return self._send(h, 200, f.read_bytes(), "text/xml;charset=UTF-8")
        return self._send(h, 404, b"not found", "text/plain")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, ctype: str) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxy between the in-process clients and the loopback server."""
    for k in list(os.environ):
        if k.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


@pytest.fixture
def server():  # type: ignore[no-untyped-def]
    with PriceServer() as s:
        yield s


# --- a small current catalog -------------------------------------------------------------------

def O(provider: str, itype: str, acc: str, n: float, mem: float | None, vcpus: float | None,
      ram: float | None, region: str, price: float | None, spot: float | None, zones: str = "",
      arch: str | None = None, host: str | None = None) -> Offer:
    return Offer(provider, itype, acc, n, mem, vcpus, ram, region, tuple(z for z in zones.split(";") if z),
                 price, spot, arch, host)


SEED = [
    O("aws", "p4d.24xlarge", "A100", 8, 40, 96, 1152, "us-east-1", 32.7726, 12.0, "use1-az2", "x86_64"),
    O("aws", "p4d.24xlarge", "A100", 8, 40, 96, 1152, "us-west-2", 32.7726, 11.0, "usw2-az2", "x86_64"),
    O("aws", "g5.xlarge", "A10G", 1, 22.35, 4, 16, "us-east-1", 1.2, 0.5, "use1-az1", "x86_64"),
    O("aws", "p5e.48xlarge", "H200", 8, 141, 192, 2048, "us-east-1", None, 20.0, "use1-az6", "x86_64"),
    O("azure", "Standard_ND96asr_v4", "A100", 8, 40, 96, 900, "eastus", 27.197, 2.99167),
    O("azure", "Standard_NC24ads_A100_v4", "A100-80GB", 1, 80, 24, 220, "eastus", 3.8, 0.5),
    O("gcp", "a2-highgpu-1g", "A100", 1, 40, 12, 85, "us-central1", 3.5, 1.9, "us-central1-a"),
    O("gcp", "n1-standard-8", "T4", 1, 16, 8, 30, "us-central1", 0.8, 0.3, "us-central1-a",
      host="n1-standard-8"),
    O("gcp", "g2-standard-4", "L4", 1, 24, 4, 16, "us-central1", 0.75, 0.3, "us-central1-a"),
]
SEED_AS_OF = "2025-01-15"


def seed(home: Path) -> Path:
    folder = home / "catalog"
    store.write_offers(folder / store.OFFERS_FILE, SEED)
    store.write_meta(folder, CatalogInfo(kind="user", path=str(folder), as_of=SEED_AS_OF,
                                         source="test seed", providers=("aws", "azure", "gcp")))
    return folder


def rows(home: Path) -> dict[tuple[str, str, str, str], Offer]:
    offers = store.read_offers(home / "catalog" / store.OFFERS_FILE)
    return {(o.provider, o.instance_type, o.accelerator or "", o.region): o for o in offers}


def env_for(home: Path, server: PriceServer | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "CLOUDTRAIN_", "GOOGLE_"))
           and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    env.update({"CLOUDTRAIN_HOME": str(home), "NO_COLOR": "1", "NO_PROXY": "127.0.0.1,localhost",
                "CLOUDTRAIN_HTTP_BACKOFF": "0.05", "CLOUDTRAIN_HTTP_CONNECT_TIMEOUT": "5",
                "CLOUDTRAIN_HTTP_READ_TIMEOUT": "10",
                # boto3: our server, dummy credentials, no instance metadata, no user config.
                "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials")})
    if server is not None:
        env.update({"CLOUDTRAIN_AWS_PRICING_URL": server.base,
                    "CLOUDTRAIN_AZURE_PRICES_URL": server.base,
                    "CLOUDTRAIN_GCP_BILLING_URL": server.base,
                    "AWS_ENDPOINT_URL_EC2": server.base + "/ec2"})
    env.update(extra)
    return env


def run(home: Path, server: PriceServer | None, *args: str, **extra: str
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cloudtrain", "catalog", "refresh", *args],
                          capture_output=True, text=True, timeout=120,
                          env=env_for(home, server, **extra))


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- end to end ----------------------------------------------------------------------------------

def test_refresh_all_three_sources(tmp_path: Path, server: PriceServer) -> None:
    pytest.importorskip("boto3")
    home = tmp_path / "home"
    seed(home)
    r = run(home, server, "--api-key", API_KEY)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    got = rows(home)

    # AWS on-demand: only the Linux/Shared/NA/Used/no-license row counts (not Windows,
    # Dedicated, SQL, unused reservations or the Boston Local Zone).
    p4d = got[("aws", "p4d.24xlarge", "A100", "us-east-1")]
    assert p4d.price == 21.9576
    assert p4d.spot_price == 8.25          # min over zones of each zone's latest price
    assert p4d.zones == ("use1-az2",) and p4d.vcpus == 96 and p4d.gpu_memory_gib == 40
    g5 = got[("aws", "g5.xlarge", "A10G", "us-east-1")]
    assert (g5.price, g5.spot_price) == (1.006, 0.39)   # spot from the second page
    # A known type in a region the catalog lacked: added, shape copied.
    new = got[("aws", "p4d.24xlarge", "A100", "eu-west-1")]
    assert (new.price, new.spot_price, new.accelerator_count, new.memory_gib) == \
        (24.0096, 10.3, 8, 1152)
    # Regions the source was not asked about, and rows it does not price, are kept.
    assert got[("aws", "p4d.24xlarge", "A100", "us-west-2")] == SEED[1]
    assert got[("aws", "p5e.48xlarge", "H200", "us-east-1")] == SEED[3]
    assert not [k for k in got if k[0] == "aws" and k[3].startswith("us-gov")]
    assert "m5.large" not in {k[1] for k in got}

    # Azure: Linux consumption price; Spot meter as spot; Windows / Low Priority / gov skipped.
    nd = got[("azure", "Standard_ND96asr_v4", "A100", "eastus")]
    assert (nd.price, nd.spot_price) == (26.5, 2.86)
    nc = got[("azure", "Standard_NC24ads_A100_v4", "A100-80GB", "eastus")]
    assert (nc.price, nc.spot_price) == (3.673, 0.9)
    we = got[("azure", "Standard_ND96asr_v4", "A100", "westeurope")]
    assert (we.price, we.spot_price, we.vcpus) == (29.0, 3.2, 96)
    assert not [k for k in got if k[0] == "azure" and k[3].startswith("usgov")]
    assert "Standard_E4s_v5" not in {k[1] for k in got}

    # GCP: host (cores + RAM) + GPUs, on-demand and spot.
    a2 = got[("gcp", "a2-highgpu-1g", "A100", "us-central1")]
    assert a2.price == pytest.approx(12 * 0.031611 + 85 * 0.004237 + 2.933908, abs=1e-6)
    assert a2.spot_price == pytest.approx(12 * 0.0126 + 85 * 0.0017 + 1.17, abs=1e-6)
    n1 = got[("gcp", "n1-standard-8", "T4", "us-central1")]
    assert n1.price == pytest.approx(8 * 0.031611 + 30 * 0.004237 + 0.35, abs=1e-6)
    assert n1.spot_price == pytest.approx(8 * 0.00698 + 30 * 0.00094 + 0.14, abs=1e-6)
    assert n1.host_type == "n1-standard-8"
    # G2 RAM is not in the fixture: the g2 row keeps its previous prices.
    assert got[("gcp", "g2-standard-4", "L4", "us-central1")] == SEED[8]
    assert len([k for k in got if k[0] == "gcp"]) == 3

    meta = store.read_meta(home / "catalog")
    as_of = datetime.fromisoformat(str(meta["as_of"]).replace("Z", "+00:00"))
    assert abs(datetime.now(timezone.utc) - as_of) < timedelta(minutes=5)
    src = str(meta["source"])
    for url in (f"{server.base}/offers/v1.0/aws/AmazonEC2/current/region_index.json",
                f"{server.base}/api/retail/prices?api-version=2023-01-01-preview",
                f"{server.base}/v1/services/6F81-5844-456A/skus"):
        assert url in src, src
    assert "\n" not in src and API_KEY not in src
    assert meta["providers"] == ["aws", "azure", "gcp"]

    # Both pages of Azure and GCP, both region files, both spot pages; gov never fetched.
    assert len(server.paths("/api/retail/prices")) == 2
    assert len(server.paths("/v1/services/")) == 2
    offers_paths = server.paths("/offers/")
    assert len(offers_paths) == 3 and not [p for p in offers_paths if "us-gov" in p]
    spot = [r for r in server.requests if str(r["path"]).startswith("/ec2")]
    assert len(spot) == 3                   # us-east-1 (2 pages) + eu-west-1
    body = urllib.parse.parse_qs(bytes(spot[0]["body"]).decode())  # type: ignore[arg-type]
    assert body["ProductDescription.1"] == ["Linux/UNIX"]
    for req in server.requests:
        headers = {k.lower(): v for k, v in dict(req["headers"]).items()}  # type: ignore[arg-type]
        if not str(req["path"]).startswith("/ec2"):
            assert headers["user-agent"].startswith("cloudtrain/"), headers
        if str(req["path"]).startswith("/v1/"):
            assert headers["x-goog-api-key"] == API_KEY
            assert "key" not in dict(req["query"])  # type: ignore[arg-type]
    # The $filter asks for the catalog's sizes only.
    flt = dict(server.requests[[r["path"] for r in server.requests].index(
        "/api/retail/prices")]["query"])["$filter"][0]  # type: ignore[index]
    assert "serviceName eq 'Virtual Machines'" in flt and "priceType eq 'Consumption'" in flt
    assert "armSkuName eq 'Standard_ND96asr_v4'" in flt

    # Progress went to stderr.
    assert "aws: us-east-1 (" in r.stderr and "azure: page 2" in r.stderr
    assert "gcp: page 2" in r.stderr and "Catalog refreshed" in r.stderr
    assert r.stdout == ""

    # The loader now reports the user catalog.
    info = subprocess.run([sys.executable, "-m", "cloudtrain", "catalog", "info", "--json"],
                          capture_output=True, text=True, timeout=60, env=env_for(home, None))
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["kind"] == "user" and data["as_of"] == meta["as_of"]
    assert data["path"] == str(home / "catalog")


def test_one_provider_keeps_the_others_and_quiet(tmp_path: Path, server: PriceServer) -> None:
    home = tmp_path / "home"
    seed(home)
    r = run(home, server, "--provider", "azure", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "" and r.stdout == ""
    got = rows(home)
    for o in SEED:
        if o.provider != "azure":
            assert got[(o.provider, o.instance_type, o.accelerator or "", o.region)] == o
    assert got[("azure", "Standard_ND96asr_v4", "A100", "eastus")].price == 26.5
    assert not server.paths("/offers/") and not server.paths("/v1/") \
        and not server.paths("/ec2")
    src = str(store.read_meta(home / "catalog")["source"])
    assert src.startswith("aws from your refreshed catalog from 2025-01-15; azure refreshed "), src

    # Then AWS alone, with --region: Azure's provenance from the first run is kept.
    r = run(home, server, "--provider", "aws", "--region", "eu-west-1",
            AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    assert r.returncode == 0, r.stderr
    got2 = rows(home)
    assert got2[("aws", "p4d.24xlarge", "A100", "eu-west-1")].price == 24.0096
    assert got2[("aws", "p4d.24xlarge", "A100", "us-east-1")] == SEED[0]   # not asked
    assert got2[("azure", "Standard_ND96asr_v4", "A100", "eastus")].price == 26.5
    assert server.paths("/offers/") == [
        "/offers/v1.0/aws/AmazonEC2/current/region_index.json",
        "/offers/v1.0/aws/AmazonEC2/20250601120000/eu-west-1/index.json"]
    src2 = str(store.read_meta(home / "catalog")["source"])
    assert src.split("; ")[1] in src2.split("; "), (src, src2)


def test_no_aws_credentials_keeps_spot_prices(tmp_path: Path, server: PriceServer) -> None:
    home = tmp_path / "home"
    seed(home)
    r = run(home, server, "--provider", "aws", AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="")
    assert r.returncode == 0, r.stderr
    assert "spot prices were not refreshed" in r.stderr
    assert "previous spot prices stay" in r.stderr
    got = rows(home)
    p4d = got[("aws", "p4d.24xlarge", "A100", "us-east-1")]
    assert (p4d.price, p4d.spot_price) == (21.9576, 12.0)
    assert got[("aws", "p4d.24xlarge", "A100", "eu-west-1")].spot_price is None
    assert not server.paths("/ec2")


def test_unreachable_source_exit_1_and_catalog_kept(tmp_path: Path) -> None:
    home = tmp_path / "home"
    folder = seed(home)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    dead = f"http://127.0.0.1:{closed_port()}"
    r = run(home, None, "--provider", "azure", CLOUDTRAIN_AZURE_PRICES_URL=dead)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    msg = " ".join(r.stderr.split())
    assert "could not reach 127.0.0.1 (connection refused)" in msg, msg
    assert f"the catalog in use is still your refreshed catalog from {SEED_AS_OF}" in msg
    assert "check your connection or proxy" in msg.lower()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_one_source_fails_the_others_are_written(tmp_path: Path, server: PriceServer) -> None:
    home = tmp_path / "home"
    seed(home)
    dead = f"http://127.0.0.1:{closed_port()}"
    r = run(home, server, "--provider", "azure", "--provider", "gcp", "--api-key", "wrong-key",
            CLOUDTRAIN_AZURE_PRICES_URL=dead)
    assert r.returncode == 1
    msg = " ".join(r.stderr.split())
    assert "could not reach 127.0.0.1 (connection refused)" in msg
    assert "HTTP 400" in msg and "API key not valid" in msg
    assert "wrong-key" not in r.stderr
    # Both failed: nothing written.
    assert rows(home)[("azure", "Standard_ND96asr_v4", "A100", "eastus")] == SEED[4]

    r = run(home, server, "--provider", "azure", "--provider", "gcp", "--api-key", "wrong-key")
    assert r.returncode == 1
    msg = " ".join(r.stderr.split())
    assert "the GCP prices in use are still those of your refreshed catalog" in msg, msg
    assert "(Azure refreshed)" in msg
    got = rows(home)
    assert got[("azure", "Standard_ND96asr_v4", "A100", "eastus")].price == 26.5
    assert got[("gcp", "a2-highgpu-1g", "A100", "us-central1")] == SEED[6]


def in_process(monkeypatch: pytest.MonkeyPatch, home: Path, server: PriceServer | None,
               **extra: str) -> None:
    """The environment of run(), for calling refresh() in this process."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "CLOUDTRAIN_")):
            monkeypatch.delenv(k)
    for k, v in env_for(home, server, **extra).items():
        if k.startswith(("AWS_", "CLOUDTRAIN_")):
            monkeypatch.setenv(k, v)


def test_5xx_and_429_are_retried(tmp_path: Path, server: PriceServer,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.catalog.refresh import refresh
    from cloudtrain.catalog.sources.httpfetch import Http, HttpConfig

    home = tmp_path / "home"
    seed(home)
    in_process(monkeypatch, home, server)
    server.fail["/api/retail/prices"] = [500, 429]
    sleeps: list[float] = []
    http = Http(HttpConfig.from_env(), sleep=sleeps.append)
    report = refresh(home, ["azure"], http=http)
    assert not report.failed and report.written
    assert len(server.paths("/api/retail/prices")) == 4    # 500, 429, page 1, page 2
    assert sleeps == [0.05, 0.1]                           # backoff doubles
    assert rows(home)[("azure", "Standard_ND96asr_v4", "A100", "eastus")].price == 26.5

    server.fail["/api/retail/prices"] = [502] * 5
    in_process(monkeypatch, home, server, CLOUDTRAIN_HTTP_RETRIES="2")
    report = refresh(home, ["azure"], http=Http(HttpConfig.from_env(), sleep=sleeps.append))
    err = report.failed["azure"]
    assert not err.unreachable and "HTTP 502" in err.reason and "after 3 attempts" in err.reason
    assert not report.written


def test_read_timeout(server: PriceServer) -> None:
    from cloudtrain.catalog.sources import SourceError
    from cloudtrain.catalog.sources.httpfetch import Http, HttpConfig

    server.hang.add("/slow")
    http = Http(HttpConfig(connect_timeout=2, read_timeout=0.3, retries=0, backoff=0))
    with pytest.raises(SourceError) as e:
        http.get_json(server.base + "/slow")
    assert e.value.unreachable and e.value.host == "127.0.0.1"
    assert e.value.reason == "no answer within the timeout (2 s to connect, 0.3 s to read)"


def test_gcp_needs_an_api_key(tmp_path: Path, server: PriceServer,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from cloudtrain.catalog.refresh import refresh
    from cloudtrain.errors import UserError

    home = tmp_path / "home"
    seed(home)
    in_process(monkeypatch, home, server)
    with pytest.raises(UserError) as e:            # asked for GCP by name: exit 2
        refresh(home, ["gcp"])
    assert e.value.exit_code == 2 and "CLOUDTRAIN_GCP_API_KEY" in e.value.hint
    assert not server.requests
    # All providers (none named): GCP is skipped with a note, the others refreshed.
    report = refresh(home, [], aws_client_factory=None, regions=["eu-west-1", "eastus"])
    assert "gcp" in report.skipped and set(report.refreshed) == {"aws", "azure"}
    assert not server.paths("/v1/")
    assert rows(home)[("gcp", "a2-highgpu-1g", "A100", "us-central1")] == SEED[6]


def test_refresh_from_the_shipped_snapshot(tmp_path: Path, server: PriceServer) -> None:
    """No user catalog yet: the snapshot's rows are the base; the user catalog is written."""
    from cloudtrain.catalog.load import SNAPSHOT_DIR

    home = tmp_path / "home"
    home.mkdir()
    snap = store.read_offers(SNAPSHOT_DIR / store.OFFERS_FILE)
    r = run(home, server, "--provider", "azure")
    assert r.returncode == 0, r.stderr
    got = store.read_offers(home / "catalog" / store.OFFERS_FILE)
    assert [o for o in got if o.provider != "azure"] == \
        sorted([o for o in snap if o.provider != "azure"],
               key=lambda o: (o.provider, o.accelerator or "", o.instance_type, o.region,
                              o.accelerator_count))
    nd = {(o.instance_type, o.region): o for o in got}[("Standard_ND96asr_v4", "eastus")]
    assert nd.price == 26.5
    assert "shipped snapshot" in str(store.read_meta(home / "catalog")["source"])


# --- units -----------------------------------------------------------------------------------------

def test_json_stream_reads_across_tiny_chunks() -> None:
    from cloudtrain.catalog.sources.aws import JsonStream, parse_region_prices

    doc = {"a": [1, 2.5e3, {"x": "}{]["}], "products": {"k\"1": {"v": -12}, "k2": None},
           "terms": {"Reserved": {"s": {"t": [True, False]}}, "OnDemand": {"s": {"p": "1"}}},
           "z": 12345678901234567890}
    text = json.dumps(doc, indent=1)
    for chunk in (1, 2, 3, 7, 64):
        js = JsonStream(io.StringIO(text), chunk=chunk)
        seen = {}
        for k in js.members():
            if k == "terms":
                seen[k] = {kind: (js.skip() if kind == "Reserved" else js.value())
                           for kind in js.members()}
            else:
                seen[k] = js.value()
        assert seen["terms"] == {"Reserved": None, "OnDemand": {"s": {"p": "1"}}}
        assert {k: v for k, v in seen.items() if k != "terms"} == \
            {k: v for k, v in doc.items() if k != "terms"}

    f = FIXTURES / "aws/offers/v1.0/aws/AmazonEC2/20250601120000/us-east-1/index.json"
    for chunk in (97, 1 << 20):
        with f.open() as fh:
            got = parse_region_prices(fh, "us-east-1", {"p4d.24xlarge", "g5.xlarge"}, chunk)
        assert got == {"p4d.24xlarge": 21.9576, "g5.xlarge": 1.006}


def test_gcp_sku_names() -> None:
    from cloudtrain.catalog.sources.gcp import Parts, gpu_model, host_families

    assert gpu_model("Nvidia Tesla A100") == "A100"
    assert gpu_model("Nvidia Tesla A100 80GB") == "A100-80GB"
    assert gpu_model("Nvidia H100 80GB") == "H100"
    assert gpu_model("Nvidia H100 80GB Mega") == "H100-MEGA"
    assert gpu_model("H200 141GB") == "H200"
    assert gpu_model("A4 Nvidia B200 (1 gpu slice)") == "B200"
    assert gpu_model("Nvidia L4") == "L4" and gpu_model("Nvidia Tesla T4") == "T4"
    assert gpu_model("RTX 6000 96GB") is None
    assert host_families("a3-megagpu-8g") == ("a3plus", "a3mega")
    assert host_families("a3-edgegpu-8g-nolssd") == ("a3",)
    assert host_families("n1-highmem-16") == ("n1predefined",)

    def sku(desc: str, usage: str = "OnDemand", group: str = "GPU") -> dict[str, object]:
        return {"description": desc, "serviceRegions": ["us-east4"],
                "category": {"resourceFamily": "Compute", "resourceGroup": group,
                             "usageType": usage},
                "pricingInfo": [{"pricingExpression": {"usageUnit": "h", "tieredRates": [
                    {"unitPrice": {"units": "0", "nanos": 1}},
                    {"unitPrice": {"units": "11", "nanos": 60000000}}]}}]}

    p = Parts()
    assert p.add(sku("Nvidia H100 80GB GPU running in Virginia"))
    assert p.add(sku("Nvidia H100 80GB GPU attached to Spot Preemptible VMs running in Virginia",
                     "Preemptible"))
    for ignored in ("Nvidia H100 80GB GPU attached to DWS Defined Duration VMs running in Virginia",
                    "Commitment v1: Nvidia H100 80GB GPU running in Virginia for 1 Year",
                    "Reserved Nvidia H100 80GB Mega GPU in Virginia"):
        assert not p.add(sku(ignored))
    assert not p.add(sku("Nvidia H100 80GB GPU running in Virginia", "Commit1Yr"))
    assert p.gpu == {("H100", "us-east4", False): 11.06, ("H100", "us-east4", True): 11.06}


def test_http_error_words() -> None:
    import urllib.error

    from cloudtrain.catalog.sources.httpfetch import HttpConfig, _describe

    cfg = HttpConfig()
    dns = urllib.error.URLError(socket.gaierror(-3, "Temporary failure in name resolution"))
    assert _describe(dns, cfg) == ("name resolution failed: offline, or no DNS", True, False)
    reason, unreachable, retry = _describe(urllib.error.URLError(TimeoutError("timed out")), cfg)
    assert reason.startswith("no answer within the timeout") and unreachable and not retry
    assert _describe(ConnectionResetError(), cfg)[2] is True
