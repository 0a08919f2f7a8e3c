"""The error tree.

Every error cloudtrain raises on purpose is a :class:`CloudtrainError`. Each carries an
``exit_code`` for the CLI and a ``hint`` that tells the user what to do next. The CLI prints
``message`` and ``hint`` as one paragraph, never a traceback.

    CloudtrainError (1)
    ├── UserError (2)                 bad input: the user must change something
    │   ├── SpecError                 the task file is wrong (names the field and line)
    │   ├── ClusterNotFound           no such cluster
    │   ├── MissingSDK                a cloud's SDK extra is not installed
    │   └── NotAsked                  a setting the cloud needs first is missing
    │       └── NoCallerAddress       this machine's public IP, for the SSH rule, is unknown
    ├── ProviderError (1)             the provider could not do what was asked
    │   ├── CapacityError             try another zone
    │   ├── QuotaError                try another region / raise the quota
    │   ├── AuthError                 stop: nothing else will work
    │   │   └── NoCredentials         none found: no call reached the cloud
    │   └── TransientError            retry with backoff
    ├── RemoteError (1)               SSH / bootstrap / sync on a node failed
    │   ├── SSHTimeout
    │   └── HostKeyMismatch
    └── JobFailed (job's exit code)   the user's job exited non-zero on a node
"""

from __future__ import annotations


class CloudtrainError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} {self.hint}"
        return self.message


class UserError(CloudtrainError):
    exit_code = 2


class SpecError(UserError):
    """The task file is invalid. ``field`` is the dotted path of the offending field."""

    def __init__(self, message: str, hint: str = "", field: str = "", line: int | None = None,
                 source: str = "") -> None:
        where = ""
        if source:
            where = f"{source}"
            if line is not None:
                where += f", line {line}"
            where += ": "
        if field:
            message = f"{where}field '{field}': {message}"
        else:
            message = f"{where}{message}"
        super().__init__(message, hint)
        self.field = field
        self.line = line


class ClusterNotFound(UserError):
    def __init__(self, name: str, known: list[str] | None = None) -> None:
        hint = "Run 'cloudtrain status' to see your clusters."
        if known:
            from difflib import get_close_matches

            close = get_close_matches(name, known, n=1)
            if close:
                hint = f"Did you mean '{close[0]}'? " + hint
        super().__init__(f"No cluster named '{name}'.", hint)
        self.name = name


class MissingSDK(UserError):
    """A provider's SDK (its pip extra) is not installed: nothing reached the cloud."""

    def __init__(self, provider: str, module: str) -> None:
        super().__init__(f"The {provider} provider needs its SDK ({module}), which is not "
                         "installed here.",
                         f"Install it: pip install 'cloudtrain[{provider}]'.")
        self.provider = provider
        self.module = module


class NotAsked(UserError):
    """A setting the provider needs before its first call (e.g. an Azure subscription) is
    missing: the cloud was not asked anything."""


class NoCallerAddress(NotAsked):
    """This machine's public IP address (the SSH rule's source) could not be found: the clouds
    look it up before they create anything."""


def reached_nothing(exc: BaseException) -> bool:
    """Whether ``exc`` says that nothing reached the cloud: the provider could not be asked at
    all (no SDK, no credentials, no subscription), or stopped before its first call that
    creates anything (this machine's address unknown). Then this process created nothing
    there."""
    return isinstance(exc, (MissingSDK, NoCredentials, NotAsked))


class ProviderError(CloudtrainError):
    """The provider could not do what was asked. ``code`` is the provider's own word for
    the failure (an AWS/ARM error code, a GCE operation error, ...), ``zone`` where it
    happened when it was one zone; both None when unknown. Providers pass them as keyword
    arguments: ``CapacityError(text, hint, code="InsufficientInstanceCapacity")``."""

    def __init__(self, message: str, hint: str = "", *, code: str | None = None,
                 zone: str | None = None) -> None:
        super().__init__(message, hint)
        self.code: str | None = code
        self.zone: str | None = zone


class CapacityError(ProviderError):
    """No capacity for the requested shape here; another zone may have it."""


class QuotaError(ProviderError):
    """An account limit was hit; another region (or a quota increase) may help."""


class AuthError(ProviderError):
    """Credentials or permissions are missing: nothing else will work until fixed."""


class NoCredentials(AuthError):
    """No credentials could be found or loaded at all: the provider cannot be asked, and no
    call of this process reached the cloud with them (so nothing was created by it)."""


class TransientError(ProviderError):
    """Throttling or a passing fault: retry with backoff."""


def code_of(exc: BaseException) -> str:
    """The code of a provider error (``ProviderError.code``), else the exception's class
    name: what attempt records and messages call a failure."""
    if isinstance(exc, ProviderError) and exc.code:
        return exc.code
    return type(exc).__name__


class RemoteError(CloudtrainError):
    pass


class SSHTimeout(RemoteError):
    pass


class HostKeyMismatch(RemoteError):
    pass


class JobFailed(CloudtrainError):
    def __init__(self, code: int, node: int | None, message: str, hint: str = "") -> None:
        super().__init__(message, hint)
        self.exit_code = code if 0 < code < 256 else 1
        self.node = node


class Interrupted(CloudtrainError):
    exit_code = 130
