"""Code archive checks: each hostile archive is refused with the limit it broke."""

from __future__ import annotations

import io
import stat
import warnings
import zipfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.api import errors
from services.api.archive import ArchiveLimits, check_archive


def _zip(*members: tuple[str | zipfile.ZipInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names, on purpose
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in members:
                zf.writestr(name, data)
    return buf.getvalue()


def test_a_plain_code_archive_passes() -> None:
    assert (
        check_archive(_zip(("train.py", b"print(1)\n"), ("pkg/", b""), ("pkg/m.py", b"x=1"))) == 2
    )


def test_not_a_zip_is_a_bad_request() -> None:
    with pytest.raises(errors.BadRequest, match="not a valid zip"):
        check_archive(b"PK\x03\x04 not really")


@pytest.mark.parametrize("members", [(), (("only/", b""),)])
def test_an_empty_archive_is_refused(members: tuple[tuple[str, bytes], ...]) -> None:
    with pytest.raises(errors.BadRequest, match="empty"):
        check_archive(_zip(*members))


def test_a_zip_bomb_is_refused_by_its_ratio_without_expanding_it() -> None:
    bomb = _zip(("zeros.bin", b"\0" * (20 * 1024 * 1024)))
    assert len(bomb) < 100 * 1024
    with pytest.raises(errors.TooLarge, match=r"compressed \d+:1; at most 200:1"):
        check_archive(bomb)


def test_member_count_member_size_and_total_size_each_have_a_limit() -> None:
    limits = ArchiveLimits(max_members=3, max_member_bytes=100, max_total_bytes=150)
    with pytest.raises(errors.TooLarge, match="4 members; at most 3"):
        check_archive(_zip(*((f"f{i}", b"x") for i in range(4))), limits)
    with pytest.raises(errors.TooLarge, match="at most 100 per file"):
        check_archive(_zip(("big", b"x" * 101)), limits)
    with pytest.raises(errors.TooLarge, match="more than 150 bytes"):
        check_archive(_zip(("a", b"x" * 80), ("b", b"x" * 80)), limits)


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../escape.py", "'..'"),
        ("a/../../escape.py", "'..'"),
        ("/etc/cron.d/x", "absolute"),
        ("C:/Windows/x", "absolute"),
        ("a\\..\\b", "backslash"),
    ],
)
def test_path_tricks_are_refused(name: str, why: str) -> None:
    with pytest.raises(errors.BadRequest, match=why):
        check_archive(_zip((name, b"x")))


def test_symlinks_and_duplicates_are_refused() -> None:
    link = zipfile.ZipInfo("evil")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    with pytest.raises(errors.BadRequest, match="symbolic link"):
        check_archive(_zip((link, b"/etc/shadow")))
    with pytest.raises(errors.BadRequest, match="twice"):
        check_archive(_zip(("a.py", b"1"), ("a.py", b"2")))


def test_a_corrupt_member_is_found() -> None:
    data = bytearray(_zip(("train.py", b"print('hello, world')\n" * 50)))
    data[40] ^= 0xFF  # inside the compressed stream
    with pytest.raises(errors.BadRequest):
        check_archive(bytes(data))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_give_a_clear_error_never_a_crash(data: bytes) -> None:
    try:
        check_archive(data)
    except errors.ApiError as exc:
        assert exc.message


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            # zipfile cuts a name at NUL (and cannot write the empty name that leaves) and
            # cannot encode a lone surrogate: names no archive tool could produce
            st.text(
                st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]),
                min_size=1,
                max_size=20,
            ),
            st.binary(max_size=200),
        ),
        min_size=0,
        max_size=8,
    ),
    st.integers(min_value=0, max_value=400),
    st.integers(min_value=0, max_value=255),
)
def test_mutated_archives_pass_or_give_a_clear_error(
    members: list[tuple[str, bytes]], offset: int, flip: int
) -> None:
    data = bytearray(_zip(*members))
    if data and flip:
        data[offset % len(data)] ^= flip
    try:
        check_archive(bytes(data))
    except errors.ApiError as exc:
        assert exc.message


def test_random_corruptions_of_a_real_archive_never_crash() -> None:
    import random

    rng = random.Random(7)
    base = _zip(("a.py", b"print(1)\n" * 100), ("d/", b""), ("d/b.txt", b"hello" * 50))
    refused = 0
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            check_archive(bytes(data))
        except errors.ApiError as exc:
            assert exc.message
            refused += 1
    assert refused > 1000  # most corruptions are caught, none crashed
