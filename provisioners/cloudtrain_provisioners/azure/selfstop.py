"""How an Azure node ends its own billing with no user secret on it (the node guard, issue 12).

On Azure a guest OS shutdown leaves the VM *allocated*: it bills on as if it ran. Only ARM
can deallocate it. So each VM of a cluster is created with a **system-assigned managed
identity** (Azure mints it, holds its secret and hands the VM short-lived tokens through
the Instance Metadata Service at 169.254.169.254; the identity is deleted with the VM), and
``up`` gives that identity the built-in **Virtual Machine Contributor** role on the cluster's
**own resource group** and nothing else. Why this role: it is built in (no tenant-wide custom
role definition to create, count against the tenant's limit and clean up), it covers the
three calls the node makes (read its VM, tag it, ``deallocate``), and the group it is scoped
to holds nothing but this cluster. It cannot delete the group, touch another group, read a
secret or assign roles.

Creating a role assignment needs ``Microsoft.Authorization/roleAssignments/write`` (Owner or
User Access Administrator, or Role Based Access Control Administrator, on the subscription:
the group does not exist before ``up``). ``up`` asks ARM for the caller's permissions before
it creates anything and stops with :func:`permission_error` when that one is missing; a
refusal later (an assignment denied by a policy) fails ``up``, which rolls back.

The node's side (:func:`command`): python3's standard library gets a token for ARM the
way Azure's own SDKs (azure-identity's ``ManagedIdentityCredential``) do, honouring their
documented variables when the node's environment sets them: ``IDENTITY_ENDPOINT`` with
``IDENTITY_HEADER`` (the identity endpoint of App Service, Functions and Container Apps:
``api-version=2019-08-01``, the secret in the ``X-IDENTITY-HEADER`` header), else the
Instance Metadata Service at ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` (AAD Pod Identity's
override) or 169.254.169.254 (``api-version=2018-02-01``, ``Metadata: true``). ARM's TLS is
checked against ``REQUESTS_CA_BUNDLE`` when set (the bundle the SDKs' requests transport
uses), else the system's CAs (OpenSSL's ``SSL_CERT_FILE``/``SSL_CERT_DIR`` apply). It tags
its VM ``cloudtrain:guard-stop = "<reason> <epoch>"``, POSTs ``deallocate`` on it,
and when ARM accepted that, shuts the guest down. Throttling, server faults and 401/403 are
retried for about five minutes (a new role assignment can take minutes to reach every ARM
cache). When the token or the deallocation still fails it prints why (the guard's log) and
exits 1 without shutting down: a guest shutdown alone would keep the VM billing while making
it unreachable. A failed tag does not stop the deallocation (compute billing comes first);
the VM then stops without being reported as self-stopped. :func:`stopped` reads the tag back
at the next contact.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from datetime import datetime
from typing import Any, Callable

from cloudtrain.errors import ProviderError, UserError
from cloudtrain.provider import SelfStop

from .api import AUTHZ_API, Api, RoleAssignment, assign_role

ROLE = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
ROLE_NAME = "Virtual Machine Contributor"
WRITE = "Microsoft.Authorization/roleAssignments/write"
COMPUTE_API = "2024-03-01"
IMDS = "http://169.254.169.254"
"""Where the token comes from on a VM (``AZURE_POD_IDENTITY_AUTHORITY_HOST`` names another)."""
GUEST_SHUTDOWN = "sudo -n shutdown -h now || shutdown -h now"

NO_IDENTITY = ("echo 'cloudtrain-guard: azure: this cluster was made with resources.azure."
               "self_stop: false; its VMs have no identity and cannot deallocate themselves (a "
               "guest shutdown would keep them billing): left running until cloudtrain down' >&2;"
               " exit 1")

WHAT_STILL_BILLS = (
    "On Azure a node's guard deallocates its VM (compute stops billing); until the next "
    "cloudtrain contact (status --refresh, down, gc) deletes the cluster's resource group, "
    "its OS disks and Standard public IP addresses still bill, and its network interfaces, "
    "network security group and virtual network stay (free).")


def plan_line(group: str) -> str:
    return (f"per VM: a system-assigned managed identity with the {ROLE_NAME} role on {group} "
            "only, so the node guard can deallocate the VM (needs the right to create role "
            "assignments; resources.azure.self_stop: false turns it off)")


def allowed(permissions: list[dict[str, Any]], action: str) -> bool:
    """Whether ARM's permission list (``actions``/``notActions`` with wildcards, any entry)
    allows ``action``."""
    a = action.lower()

    def hit(patterns: Any) -> bool:
        return any(fnmatch.fnmatchcase(a, str(p).lower()) for p in patterns or [])

    return any(hit(p.get("actions")) and not hit(p.get("notActions")) for p in permissions)


def can_assign(api: Api) -> bool | None:
    """Whether the caller may create role assignments in the subscription (None: ARM did
    not say; the assignment itself will tell)."""
    try:
        got = api.rest("read your permissions", "GET",
                       f"/subscriptions/{api.subscription_id}/providers/Microsoft.Authorization/"
                       f"permissions?api-version={AUTHZ_API}")
    except ProviderError:
        return None
    return allowed(list((got or {}).get("value") or []), WRITE)


def permission_error(subscription: str, detail: str = "") -> UserError:
    """``detail``: ARM's refusal, when the assignment itself was refused (``up`` then rolls
    back what it made); without it, ``up`` asked before creating anything."""
    done = "what up created is being removed" if detail else "nothing was created"
    return UserError(
        f"Azure: your identity may not create role assignments "
        f"({WRITE}) in subscription {subscription}{detail}. cloudtrain gives each VM a "
        f"managed identity with the {ROLE_NAME} role on the cluster's own resource group, so "
        "that the node guard can deallocate the VM when autostop, a job's end, the budget or "
        f"the lifetime says so (a guest shutdown alone keeps an Azure VM billing); {done}.",
        "Ask for the User Access Administrator (or Owner, or Role Based Access Control "
        "Administrator) role on the subscription, or turn the self-stop off with "
        "'resources.azure.self_stop: false' in the task, accepting that the nodes can then "
        "never end their own billing (no autostop, job-end, budget or lifetime stop: the "
        "cluster bills until you run 'cloudtrain down').")


def grant(api: Api, group: str, vms: list[Any], sleep: Callable[[float], None],
          tries: int = 12) -> None:
    """The role on ``group`` for each VM's identity (one assignment per identity, named
    from it, so a repeated ``up`` writes the same one). A brand-new identity may not have
    reached Azure AD's replicas yet (``PrincipalNotFound``): retried with backoff."""
    scope = f"/subscriptions/{api.subscription_id}/resourceGroups/{group}"
    for vm in vms:
        if not vm.principal:
            raise ProviderError(f"VM {vm.name} has no managed identity.",
                                "Run 'cloudtrain down' and 'up' again (VMs made before the "
                                "self-stop have none).")
        assign_role(api, RoleAssignment(vm.principal, ROLE, scope),
                    f"give VM {vm.name}'s identity the {ROLE_NAME} role on {group}",
                    sleep=sleep, tries=tries,
                    denied=lambda exc: permission_error(api.subscription_id,
                                                        f" (ARM refused: {exc.message})"))


# The node's side: python3 standard library only; no single quote in it (it is quoted so).
NODE_PY = r"""
import json, os, ssl, sys, time, urllib.error as ue, urllib.parse as up, urllib.request as ur
arm, vm, res = sys.argv[1:4]
why = os.environ.get("CT_GUARD_REASON") or "unknown"
tries = int(os.environ.get("CT_GUARD_AZURE_TRIES") or 10)
tls = ur.HTTPSHandler(context=ssl.create_default_context(cafile=os.environ.get("REQUESTS_CA_BUNDLE") or None))
local = ur.build_opener(ur.ProxyHandler({}), tls)
remote = ur.build_opener(tls)
def call(op, what, url, method="GET", body=None, hdr=None, fatal=True):
    h = dict(hdr or {})
    data = None if body is None else json.dumps(body).encode()
    if method == "POST" and data is None:
        data = b""
    if data is not None:
        h["Content-Type"] = "application/json"
    for i in range(tries):
        try:
            with op.open(ur.Request(url, data=data, method=method, headers=h), timeout=20) as f:
                t = f.read()
            return json.loads(t) if t.strip() else {}
        except ue.HTTPError as e:
            err = "HTTP %d %s" % (e.code, e.read()[:400].decode("utf-8", "replace"))
            if e.code in (400, 404, 409):
                break
        except (OSError, ValueError) as e:
            err = repr(e)
        if i + 1 < tries:
            time.sleep(min(60, 2 ** i))
    print("cloudtrain-guard: azure: %s failed: %s" % (what, err), file=sys.stderr, flush=True)
    if fatal:
        sys.exit(1)
    return {}
q = "resource=" + up.quote(res, safe="")
ep, secret = os.environ.get("IDENTITY_ENDPOINT"), os.environ.get("IDENTITY_HEADER")
if ep and secret:
    src = ep + ("&" if "?" in ep else "?") + "api-version=2019-08-01&" + q
    hdr = {"X-IDENTITY-HEADER": secret}
else:
    host = (os.environ.get("AZURE_POD_IDENTITY_AUTHORITY_HOST") or "IMDS").rstrip("/")
    src = host + "/metadata/identity/oauth2/token?api-version=2018-02-01&" + q
    hdr = {"Metadata": "true"}
tok = call(local, "token from the managed identity endpoint", src, hdr=hdr)["access_token"]
h = {"Authorization": "Bearer " + tok}
url = arm + vm + "?api-version=API"
tg = call(remote, "read VM", url, hdr=h, fatal=False).get("tags") or {}
tg["cloudtrain:guard-stop"] = "%s %d" % (why, time.time())
call(remote, "tag VM", url, "PATCH", {"tags": tg}, h, fatal=False)
call(remote, "deallocate VM", arm + vm + "/deallocate?api-version=API", "POST", None, h)
print("cloudtrain-guard: azure: deallocation of %s accepted (%s)" % (vm, why), flush=True)
""".replace("API", COMPUTE_API).replace("IMDS", IMDS).strip()


def command(vm_id: str, *, arm: str) -> str:
    """The shell command the guard runs on the node of VM ``vm_id`` (its ARM id): the token,
    the tag, the deallocation (see the module's docstring), then the guest shutdown."""
    arm = arm.rstrip("/")
    args = " ".join(shlex.quote(a) for a in (arm, vm_id, arm + "/"))
    return f"python3 -c {shlex.quote(NODE_PY)} {args} && {{ {GUEST_SHUTDOWN}; }}"


def _epoch(iso: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?$", iso.strip())
    if not m:
        return None
    frac = (m.group(2) or ".0")[:7]
    zone = m.group(3) or "Z"
    return datetime.fromisoformat(m.group(1) + frac + ("+00:00" if zone == "Z" else zone)
                                  ).timestamp()


def stopped(vms: list[Any]) -> list[SelfStop]:
    """The VMs a guard deallocated: deallocated (or deallocating) and tagged by it; when,
    from Azure's record of the VM's last operation (else the guard's own clock)."""
    out = []
    for v in vms:
        if not v.guard_stop or v.power not in ("deallocated", "deallocating"):
            continue
        reason, _, at = v.guard_stop.partition(" ")
        when = _epoch(v.state_time) if v.state_time else None
        if when is None:
            try:
                when = float(at)
            except ValueError:
                when = 0.0
        out.append(SelfStop(rank=v.rank if v.rank is not None else 0, instance_id=v.id,
                            stopped_at=when, reason=reason or None))
    return sorted(out, key=lambda s: s.rank)

