"""The git checkout fp4lab works in: the commit a run was made from, and the plumbing the ratchet
uses to keep its iterations as commits (`git` in a subprocess, never a shell)."""

from __future__ import annotations

import subprocess
from pathlib import Path

GIT_TIMEOUT_S = 60


class GitError(RuntimeError):
    """A git command failed: the message names the command, the folder and git's own reason (`reason`)."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message


def git_state() -> tuple[str | None, bool | None]:
    """The checkout's commit and whether it has uncommitted changes (None outside a git checkout)."""
    try:
        import git
    except ImportError:  # gitpython (or the git binary it needs at import) missing
        return None, None
    try:
        repo = git.Repo(search_parent_directories=True)
        return repo.head.commit.hexsha, repo.is_dirty(untracked_files=False)
    except (OSError, ValueError, git.exc.GitError):  # not a checkout, no git binary, empty repo
        return None, None


def git(cwd: Path, *args: str, stdin: str | None = None, strip: bool = True, config: tuple[str, ...] = ()) -> str:
    """stdout of `git [-c k=v ...] -C cwd args...`; GitError with git's last stderr line on failure."""
    command = ["git", *(f for item in config for f in ("-c", item)), "-C", str(cwd), *args]
    try:
        done = subprocess.run(command, input=stdin, capture_output=True, timeout=GIT_TIMEOUT_S,
                              encoding="utf-8", errors="surrogateescape")
    except FileNotFoundError:
        raise GitError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"git {' '.join(args[:3])} in {cwd} took more than {GIT_TIMEOUT_S} s",
                       f"git {args[0]} took more than {GIT_TIMEOUT_S} s") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"git exited with {done.returncode}"])[-1]
        raise GitError(f"git {' '.join(args[:3])} in {cwd} failed: {reason}", reason)
    return done.stdout.strip() if strip else done.stdout


def succeeds(cwd: Path, *args: str) -> bool:
    """Whether a git query (rev-parse --verify, config KEY, ...) exits 0."""
    try:
        return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, timeout=GIT_TIMEOUT_S).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def repo_root(folder: Path) -> Path:
    """The top of the git checkout holding `folder`, which must have a commit."""
    try:
        root = Path(git(folder, "rev-parse", "--show-toplevel"))
    except GitError as exc:
        if "not installed" in str(exc):
            raise GitError("git is not installed; the ratchet keeps its iterations as git commits") from None
        raise GitError(f"{folder} is not inside a git repository; the ratchet needs one (git init && git commit)") from None
    if not succeeds(root, "rev-parse", "--verify", "-q", "HEAD"):
        raise GitError(f"{root} has no commit yet; commit your work first (the ratchet branches from HEAD)")
    return root


def commit(worktree: Path, message: str) -> None:
    """Commit what is staged, with a stand-in identity where the user has none configured."""
    identity = tuple(f"{key}={fallback}" for key, fallback in (("user.name", "fp4lab ratchet"), ("user.email", "ratchet@fp4lab.invalid"))
                     if not succeeds(worktree, "config", key))
    git(worktree, "commit", "-q", "--no-verify", "-m", message, config=identity)


def reset(worktree: Path, commit_ish: str) -> None:
    """Make the worktree exactly `commit_ish`: tracked changes and untracked files gone."""
    git(worktree, "reset", "-q", "--hard", commit_ish)
    git(worktree, "clean", "-q", "-fd")


def save_and_reset(worktree: Path, patch: Path) -> None:
    """Only the ratchet edits its worktree, but save whatever is there as a patch before resetting it."""
    if not git(worktree, "status", "--porcelain"):
        return
    git(worktree, "add", "-A")
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(git(worktree, "diff", "--cached", "--binary", strip=False))
    reset(worktree, "HEAD")
