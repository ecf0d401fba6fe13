"""etcd authentication on the embedded platform (`rhizome up`, issue #15).

`up` turns etcd's authentication on the first time it starts its own etcd and keeps two
credential files, each `USER:PASSWORD` at mode 0600, in `<data dir>/etcd-auth/` (0700):

- `root.credentials`: etcd's superuser. Only the daemon hosting the LCM is told where it is
  (`$RHIZOME_ETCD_ROOT_CREDENTIALS_FILE`): it makes each job's etcd user, scoped to the
  job's prefix, when it starts the job's guardian, and removes it when the job ends.
- `platform.credentials`: the platform's user, whose role reads and writes only under
  `/rhizome/`. The daemon, its guardians and the platform's helpers authenticate as it
  through `$RHIZOME_ETCD_CREDENTIALS_FILE`, which `contract.etcd.EtcdClient` reads by
  itself, so no call site names credentials.

Learners never get either file: their controller receives the job's own user in its 0600
learner spec (docs/security.md).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from contract import etcd_keys
from contract.env import ETCD_CREDENTIALS_FILE
from contract.etcd import ETCD_ROOT_CREDENTIALS_FILE, EtcdAuthError, EtcdClient, EtcdCredentials
from contract.etcd_users import enable_auth

AUTH_DIR = "etcd-auth"
ROOT_FILE = "root.credentials"
PLATFORM_FILE = "platform.credentials"
ROOT_USER = "root"  # etcd requires this name for the user that may enable authentication
PLATFORM_USER = "rhizome-platform"


class EtcdAuthSetupError(RuntimeError):
    """The embedded etcd's authentication cannot be set up; the message says what to do."""


@dataclass(frozen=True)
class EtcdAuthFiles:
    """Where `up` keeps the two credential files of the embedded etcd."""

    root: Path
    platform: Path

    @classmethod
    def of(cls, data_dir: Path) -> EtcdAuthFiles:
        folder = Path(data_dir) / AUTH_DIR
        return cls(folder / ROOT_FILE, folder / PLATFORM_FILE)

    def daemon_environ(self) -> dict[str, str]:
        """What the daemon is told: its own user, and root for the LCM's job users."""
        return {
            ETCD_CREDENTIALS_FILE: str(self.platform),
            ETCD_ROOT_CREDENTIALS_FILE: str(self.root),
        }

    def client_environ(self) -> dict[str, str]:
        """What a platform helper run beside the daemon (the CLI's injector, a benchmark)
        is told: the platform's user, never root."""
        return {ETCD_CREDENTIALS_FILE: str(self.platform)}


def platform_credentials(data_dir: Path) -> EtcdCredentials | None:
    """The platform user of the embedded platform in `data_dir`, for a platform helper the
    CLI runs against it (`rhizome inject --job`); None where `up` enabled no authentication
    (an etcd of yours: `$RHIZOME_ETCD_CREDENTIALS_FILE` names its user)."""
    path = EtcdAuthFiles.of(data_dir).platform
    return EtcdCredentials.from_file(path) if path.exists() else None


def _load_or_make(path: Path, user: str) -> EtcdCredentials:
    if path.exists():
        return EtcdCredentials.from_file(path)
    credentials = EtcdCredentials(user, secrets.token_urlsafe(32))
    credentials.write(path)
    return credentials


def ensure_etcd_auth(data_dir: Path, url: str) -> EtcdAuthFiles:
    """Authentication on the etcd at `url` (the platform's own), with the credentials in
    `<data_dir>/etcd-auth/` (made on first use); checked by authenticating as the platform
    user. An etcd whose authentication is on with other passwords (the files were lost) is
    an `EtcdAuthSetupError` saying how to recover."""
    files = EtcdAuthFiles.of(data_dir)
    files.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(files.root.parent, 0o700)
    try:
        root = _load_or_make(files.root, ROOT_USER)
        platform = _load_or_make(files.platform, PLATFORM_USER)
    except (OSError, ValueError) as exc:
        raise EtcdAuthSetupError(f"the embedded etcd's credentials: {exc}") from exc
    enable_auth(url, root, platform, etcd_keys.ROOT + "/")
    try:
        EtcdClient.connect(url, credentials=platform).close()
    except EtcdAuthError as exc:
        raise EtcdAuthSetupError(
            f"the embedded etcd has authentication on, but refuses the credentials in "
            f"{files.platform.parent} ({exc}): restore the files of the run that enabled it, "
            f"or remove {Path(data_dir) / 'deps' / 'etcd'} to start with an empty etcd"
        ) from exc
    return files
