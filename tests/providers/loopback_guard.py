"""The sitecustomize the CLI tests put in a subprocess's path: a connection to any address
that is not loopback is refused and logged in $CT_TEST_GUARD_LOG (a test fails when the log
holds a line): nothing a test runs may reach an address a fake cloud invented."""

GUARD = '''
import ipaddress, os, socket
_log = os.environ["CT_TEST_GUARD_LOG"]
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex

def _ok(sock, address):
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return True
    try:
        return ipaddress.ip_address(address[0]).is_loopback
    except ValueError:
        return False

def _refuse(address):
    with open(_log, "a") as f:
        f.write(f"{os.getpid()} {address!r}\\n")
    raise ConnectionRefusedError(111, f"test guard: {address!r} is not loopback")

def connect(self, address):
    if not _ok(self, address):
        _refuse(address)
    return _connect(self, address)

def connect_ex(self, address):
    if not _ok(self, address):
        _refuse(address)
    return _connect_ex(self, address)

socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
'''
