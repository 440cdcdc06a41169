"""Hostfile parser and include/exclude filter: examples for every error, properties for the rest."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dslaunch.errors import HostfileError
from dslaunch.launcher.hostfile import apply_filter, full_pool, parse_filter, parse_hostfile, read_hostfile

pytestmark = pytest.mark.timeout(60)


def test_parses_comments_blank_lines_and_trailing_comments():
    text = "# cluster\n\nworker-1 slots=4  # fast\n  worker-2\tslots=2\n"
    assert parse_hostfile(text) == {"worker-1": 4, "worker-2": 2}


@pytest.mark.parametrize("text, line, words", [
    ("a slots=2\nb slots=1\na slots=3\n", 3, "duplicate host 'a' (first listed on line 1)"),
    ("a slots=2\nb\n", 2, "has no 'slots=N'"),
    ("a slots=0\n", 1, "must be a positive integer"),
    ("a slots=-2\n", 1, "must be a positive integer"),
    ("a slots=2.5\n", 1, "is not an integer"),
    ("a slots=\n", 1, "is not an integer"),
    ("a slots=1_0\n", 1, "slots='1_0' is not an integer (digits 0-9 only)"),  # int() would say 10
    ("a slots=\uff12\n", 1, "unexpected character U+FF12 at column 9"),  # a fullwidth digit 2
    ("a slots=+2\n", 1, "is not an integer"),
    ("a slots=80000000000\n", 1, "slots=80000000000 is too large (at most 4096"),
    ("a slots=" + "9" * 5000 + "\n", 1, "is not an integer"),  # beyond int()'s digit limit
    ("a slots=2 extra\n", 1, "unexpected 'extra'"),
    ("\n\na slot=2\n", 3, "unknown key 'slot' (did you mean 'slots'?)"),
    ("a gpus=2\n", 1, "unknown key 'gpus'"),
    ("a slots=2 slots=3\n", 1, "'slots' given twice"),
    ("slots=2\n", 1, "expected a hostname first"),
    ("a/b slots=2\n", 1, "invalid hostname"),
    ("node1 slots=2\nNode1 slots=2\n", 2, "duplicate host 'Node1' (as 'node1': host names are case-insensitive)"),
    ("-oProxyCommand=x slots=1\n", 1, "expected a hostname first"),
    ("-node slots=1\n", 1, "invalid hostname '-node': expected labels of letters"),
    ("node- slots=1\n", 1, "invalid hostname 'node-'"),
    ("a..b slots=1\n", 1, "invalid hostname 'a..b'"),
    ("a:b slots=1\n", 1, "invalid hostname 'a:b': not an IPv6 address"),
    ("x" * 64 + ".b slots=1\n", 1, "is 64 characters long (at most 63)"),
    ("a." * 127 + "b slots=1\n", 1, "255 characters long (host names have at most 253)"),
    ("a\x0bslots=2\n", 1, "unexpected character U+000B at column 2"),
    ("a slots=2\x0c\n", 1, "unexpected character U+000C at column 10"),
    ("a\rslots=2\n", 1, "unexpected character U+000D"),
    ("a slots=2\u2028b slots=3\n", 1, "unexpected character U+2028"),
    ("#\x0c\x85\n# x\u2028y\x0cz\na slots=x\n", 3, "slots='x' is not an integer"),  # no extra lines
    ("".join(f"h{i} slots=4096\n" for i in range(17)), 17, "have 69632 slots; dslaunch runs at most 65536 ranks"),
])
def test_errors_name_file_and_line(text, line, words):
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "hf")
    assert str(info.value).startswith(f"hf:{line}: ")
    assert words in str(info.value)


def test_only_newline_ends_a_line_so_a_comment_stays_a_comment():
    text = "# retired: node9\u2028node9 slots=8\n# old\x85node8 slots=8\x0bnode7 slots=1\nnode1 slots=2\r\n"
    assert parse_hostfile(text) == {"node1": 2}


def test_ip_literals_are_hosts():
    text = "10.0.0.1 slots=1\nfe80::1 slots=1\n[2001:db8::2] slots=1\nnode_1.example.com. slots=1\n"
    assert list(parse_hostfile(text)) == ["10.0.0.1", "fe80::1", "[2001:db8::2]", "node_1.example.com."]


def test_invalid_utf8_names_the_line():
    with pytest.raises(HostfileError) as info:
        parse_hostfile(b"a slots=1\n# caf\xc3\xa9\nb\xff slots=2\n", "hf")
    assert str(info.value) == "hf:3: invalid UTF-8 (byte 0xff at column 2)"


def test_a_huge_hostname_gives_a_short_error():
    with pytest.raises(HostfileError) as info:
        parse_hostfile("n" * 1_000_000 + " slots=1\n", "hf")
    assert "1000000 characters long" in str(info.value) and len(str(info.value)) < 300


@pytest.mark.parametrize("make, words", [
    (lambda tmp: "/dev/zero", "/dev/zero: not a regular file"),
    (lambda tmp: (os.mkfifo(tmp / "fifo"), str(tmp / "fifo"))[1], "fifo: not a regular file"),
    (lambda tmp: str(tmp), "not a regular file"),
    (lambda tmp: (tmp.joinpath("big").write_bytes(b"# x\n" * (2 << 20)), str(tmp / "big"))[1],
     "big: larger than 4 MiB"),
])
@pytest.mark.timeout(10)  # a FIFO must not block the read
def test_only_bounded_regular_files_are_read(tmp_path, make, words):
    with pytest.raises(HostfileError, match=words):
        read_hostfile(make(tmp_path), explicit=True)


def test_empty_hostfile_is_an_error():
    with pytest.raises(HostfileError, match="no hosts"):
        parse_hostfile("# nothing\n\n", "hf")


def test_missing_default_hostfile_means_none_but_explicit_is_an_error(tmp_path):
    missing = str(tmp_path / "hostfile")
    assert read_hostfile(missing, explicit=False) is None
    with pytest.raises(HostfileError, match="hostfile not found"):
        read_hostfile(missing, explicit=True)


HOSTS = {"h1": 4, "h2": 2, "h3": 3}


@pytest.mark.parametrize("include, exclude, expected", [
    ("h1:0,2@h3", "", {"h1": (0, 2), "h3": (0, 1, 2)}),
    ("h2", "", {"h2": (0, 1)}),
    ("h3:2,0", "", {"h3": (0, 2)}),
    ("", "h1:1@h2", {"h1": (0, 2, 3), "h3": (0, 1, 2)}),
    ("", "h3:0,1,2", {"h1": (0, 1, 2, 3), "h2": (0, 1)}),
    # a host or slot named twice counts once (DeepSpeed's test_parser_local: 'worker-0:1,1')
    ("h1:0,0", "", {"h1": (0,)}),
    ("h1:1@H1:0,1", "", {"h1": (0, 1)}),
    ("h1:1@h1", "", {"h1": (0, 1, 2, 3)}),
    ("", "h1:1,1@h1:2", {"h1": (0, 3), "h2": (0, 1), "h3": (0, 1, 2)}),
])
def test_filter_examples(include, exclude, expected):
    assert apply_filter(HOSTS, include, exclude) == expected


@pytest.mark.parametrize("include, exclude, words", [
    ("h4", "", "unknown host 'h4'"),
    ("h11:0", "", "unknown host 'h11' (did you mean 'h1'?)"),
    ("h2:2", "", "host 'h2' has slots 0-1, not 2"),
    ("", "h9", "--exclude: unknown host 'h9'"),
    ("h1:x", "", "must be integers"),
    ("h1:", "", "must be integers"),
    ("h1:1_0", "", "must be integers"),
    ("h1:\u0661", "", "must be integers"),  # an Arabic-Indic digit 1
    ("@h1", "", "empty host name"),
    ("h1", "h2", "mutually exclusive"),
    ("", "h1@h2@h3", "leaves no slots"),
    ("-h1", "", "invalid hostname '-h1'"),
    ("h1;id", "", "invalid hostname 'h1;id'"),
    ("h" * 300, "", "300 characters long"),
])
def test_filter_errors(include, exclude, words):
    with pytest.raises(HostfileError) as info:
        apply_filter(HOSTS, include, exclude)
    assert words in str(info.value) and len(str(info.value)) < 300


def test_filter_host_names_are_case_insensitive():
    assert apply_filter(HOSTS, include="H1:1@h3") == {"h1": (1,), "h3": (0, 1, 2)}
    assert apply_filter(HOSTS, exclude="H1@h3:0") == {"h2": (0, 1), "h3": (1, 2)}


# -- properties ----------------------------------------------------------------------------------

names = st.from_regex(r"[a-z]([a-z0-9-]{0,8}[a-z0-9])?(\.[a-z0-9]{1,3}){0,2}", fullmatch=True)
hostfiles = st.dictionaries(names, st.integers(1, 16), min_size=1, max_size=8)
junk = st.sampled_from(["", "   ", "# a comment", "\t# slots=3 commented out"])


@settings(max_examples=80, deadline=None)
@given(hostfiles, st.data())
def test_render_then_parse_round_trips(hosts, data):
    lines = []
    for h, n in hosts.items():
        lines.append(data.draw(junk))
        sep = data.draw(st.sampled_from([" ", "  ", "\t"]))
        comment = data.draw(st.sampled_from(["", " # note", "#x"]))
        lines.append(f"{data.draw(st.sampled_from(['', '  ']))}{h}{sep}slots={n}{comment}")
    assert parse_hostfile("\n".join(lines) + "\n") == hosts


@settings(max_examples=50, deadline=None)
@given(hostfiles, st.integers(1, 16), st.data())
def test_duplicate_host_is_reported_on_its_second_line(hosts, slots, data):
    dup = data.draw(st.sampled_from(sorted(hosts)))
    text = "".join(f"{h} slots={n}\n" for h, n in hosts.items()) + f"{dup} slots={slots}\n"
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "hf")
    assert info.value.line == len(hosts) + 1


# Arbitrary text, plus near-misses built from the syntax's own characters (random text alone
# rarely gets past the first token).
any_text = st.one_of(st.text(), st.text(alphabet="h1 slots=0123456789_#:,@\t\n\r\x0b\x85\u2028-+\uff11"))


# Bytes: valid lines, their near-misses and separators (VT, FF, NEL, U+2028, CR, NUL), invalid UTF-8.
_PIECES = [b"h1", b"node-2", b"N", b" ", b"\t", b"slots=", b"4", b"0", b"4097", b"#", b"=", b"\n", b"\r", b"\r\n",
           b"\x0b", b"\x0c", b"\x1c", b"\x00", "\x85".encode(), "\u2028".encode(), b"\xff", b"\xc3", b"-", b":",
           b"[", b"]", b".", b"_", b"x" * 70]
any_bytes = st.one_of(st.binary(max_size=300),
                      st.lists(st.sampled_from(_PIECES), max_size=60).map(b"".join),
                      any_text.map(lambda t: t.encode("utf-8", "surrogatepass")))


def _parsed_or_one_clean_error(data):
    try:
        hosts = parse_hostfile(data, "hf")
    except HostfileError as err:
        message = str(err)
        assert message.startswith("hf:") and "\n" not in message and len(message) <= 500, message
        return
    assert hosts and all(type(n) is int and 0 < n <= 4096 for n in hosts.values())
    assert len({h.lower() for h in hosts}) == len(hosts)
    assert all(h.isascii() and h.isprintable() and " " not in h and not h.startswith("-") for h in hosts)


@settings(max_examples=300, deadline=None)
@given(any_text)
def test_any_text_is_parsed_or_rejected_with_a_one_line_hostfile_error(text):
    _parsed_or_one_clean_error(text)


@settings(max_examples=400, deadline=None)
@given(any_bytes)
def test_any_bytes_are_parsed_or_rejected_with_one_short_hostfile_error(data):
    """Only HostfileError may escape (anything else fails the test), one line, at most 500 chars."""
    _parsed_or_one_clean_error(data)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.sampled_from([1, 8, 4096]))
def test_large_hostfiles_are_bounded(n_hosts, slots):
    text = "".join(f"node{i} slots={slots}\n" for i in range(n_hosts * 40))
    _parsed_or_one_clean_error(text.encode())


@settings(max_examples=300, deadline=None)
@given(any_text)
def test_any_filter_text_is_applied_or_rejected_with_a_one_line_hostfile_error(text):
    try:
        pool = apply_filter(HOSTS, include=text)
    except HostfileError as err:
        assert "\n" not in str(err)
        return
    assert pool and all(set(slots) <= set(range(HOSTS[h])) for h, slots in pool.items())


def _selection(hosts, data):
    """A random non-empty selection {host: slots or None} and its filter expression."""
    chosen = data.draw(st.lists(st.sampled_from(sorted(hosts)), min_size=1, unique=True))
    sel = {}
    for h in chosen:
        if data.draw(st.booleans()):
            sel[h] = None
        else:
            sel[h] = tuple(data.draw(st.lists(st.integers(0, hosts[h] - 1), min_size=1, unique=True)))
    expr = "@".join(h if s is None else f"{h}:{','.join(map(str, s))}" for h, s in sel.items())
    return sel, expr


@settings(max_examples=80, deadline=None)
@given(hostfiles, st.data())
def test_include_and_exclude_partition_the_pool(hosts, data):
    sel, expr = _selection(hosts, data)
    assert parse_filter(expr, "--include") == sel
    picked = {h: set(range(hosts[h])) if s is None else set(s) for h, s in sel.items()}
    included = apply_filter(hosts, include=expr)
    assert {h: set(s) for h, s in included.items()} == picked
    assert list(included) == [h for h in hosts if h in picked]  # hostfile order kept
    try:
        excluded = apply_filter(hosts, exclude=expr)
    except HostfileError as err:  # only when everything was excluded
        assert "leaves no slots" in str(err)
        excluded = {}
    union = {h: set(included.get(h, ())) | set(excluded.get(h, ())) for h in hosts}
    assert union == {h: set(s) for h, s in full_pool(hosts).items()}
    assert all(not set(included.get(h, ())) & set(excluded.get(h, ())) for h in hosts)


@settings(max_examples=50, deadline=None)
@given(hostfiles, names)
def test_include_of_an_unknown_host_is_an_error(hosts, name):
    if name in hosts:
        return
    with pytest.raises(HostfileError, match="unknown host"):
        apply_filter(hosts, include=name)


def test_example_hostfiles_parse():
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parents[2] / "hostfiles").glob("*"))
    assert examples
    for path in examples:
        assert read_hostfile(str(path), explicit=True)
