"""megatron.ciera.binding.upstream_patch: the version gate. Every upstream method the binding replaces,
copies or relies on has its source digest recorded per checked megatron-core version; a new
version fails here naming each changed method and what to re-check in it."""

import pytest

from megatron.ciera.binding import upstream_patch as upstream

from test_mc_bucket_group import FakeGather, fake_ddp, make_group

VERSION = upstream.installed_version()


def _table_to_record() -> str:
    rows = "\n".join(f'        "{name}": "{digest}",' for name, digest in upstream.installed_digests().items())
    return f'    "{VERSION}": MappingProxyType({{\n{rows}\n    }}),'


def test_installed_megatron_core_is_a_checked_version():
    assert VERSION in upstream.KNOWN_SOURCES, (
        f"megatron-core {VERSION} is not in upstream_patch.KNOWN_SOURCES ({', '.join(upstream.KNOWN_SOURCES)}); "
        "the test per method below says which upstream methods changed and what to re-check in each. Once "
        f"re-checked, record:\n{_table_to_record()}")


@pytest.mark.parametrize("method", upstream.UPSTREAM_METHODS, ids=lambda m: m.qualname)
def test_upstream_method_is_the_one_checked(method):
    known = upstream.KNOWN_SOURCES.get(VERSION)
    if known is None:  # an unchecked version: compare with the newest checked one
        known = upstream.KNOWN_SOURCES[list(upstream.KNOWN_SOURCES)[-1]]
    digest = upstream.installed_digests()[method.name]
    assert digest == known[method.name], (
        f"megatron-core {VERSION} changed {method.name} (digest {digest}, checked {known[method.name]}): "
        f"re-check that it {method.recheck}; then record \"{digest}\" for it in "
        f"upstream_patch.KNOWN_SOURCES[\"{VERSION}\"]")


def test_every_checked_version_lists_every_method():
    names = {m.name for m in upstream.UPSTREAM_METHODS}
    for version, table in upstream.KNOWN_SOURCES.items():
        assert set(table) == names, version


def test_the_gate_passes_the_installed_version():
    assert upstream.upstream_changes() == []
    upstream.check_upstream()


def test_a_changed_method_is_named_with_what_to_recheck():
    method = upstream.UPSTREAM_METHODS[0]
    digests = dict(upstream.installed_digests(), **{method.name: "0" * 16})
    changes = upstream.upstream_changes(digests=digests)
    assert len(changes) == 1 and method.name in changes[0] and method.recheck in changes[0]
    with pytest.raises(RuntimeError, match="_ParamAndGradBucketGroup.start_param_sync"):
        upstream.check_upstream(digests=digests)


def test_a_patch_release_that_edits_only_docstrings_and_comments_passes_a_changed_line_does_not():
    """The digests cover each method's code (its syntax tree, docstrings dropped): a copy of an
    upstream method with its docstring and comments edited and its lines re-wrapped passes the gate,
    one with a line of code changed is refused naming the method."""
    import ast
    import textwrap

    method = upstream.UPSTREAM_METHODS[0]
    source = textwrap.dedent(upstream._installed_source(method))
    lines = source.splitlines()
    first = ast.parse(source).body[0].body[0]  # the method's docstring
    assert isinstance(first, ast.Expr) and isinstance(first.value.value, str)
    indent = " " * first.col_offset
    edited = lines[: first.lineno - 1] + [f'{indent}"""A docstring a patch release rewrote."""',
                                          f"{indent}# and a comment it added"] + lines[first.end_lineno:]
    edited = "\n".join(edited).replace("):\n", "):  # a comment on the line\n", 1) + "\n"
    assert edited != source and upstream.source_digest(edited) == upstream.source_digest(source)
    digests = dict(upstream.installed_digests(), **{method.name: upstream.source_digest(edited)})
    assert upstream.upstream_changes(digests=digests) == []
    code = next(i for i, line in enumerate(lines) if i >= first.end_lineno and " = " in line
                and not line.strip().startswith("#"))
    changed = lines[:code] + [lines[code].replace(" = ", " = 1 + ", 1)] + lines[code + 1:]
    digests[method.name] = upstream.source_digest("\n".join(changed))
    changes = upstream.upstream_changes(digests=digests)
    assert len(changes) == 1 and method.name in changes[0]


def test_a_method_is_accepted_as_in_any_checked_version():
    """A new release that changes none of the listed methods passes (per method, any checked version)."""
    tables = list(upstream.KNOWN_SOURCES.values())
    mixed = {m.name: tables[i % len(tables)][m.name] for i, m in enumerate(upstream.UPSTREAM_METHODS)}
    assert upstream.upstream_changes(digests=mixed) == []


def test_install_refuses_a_changed_upstream_before_any_collective(monkeypatch):
    changed = {name: "0" * 16 for name in upstream.installed_digests()}
    monkeypatch.setattr(upstream, "installed_digests", lambda methods=None: changed)
    from megatron.ciera.binding import bucket_group as binding

    FakeGather.log = []
    group = make_group()
    with pytest.raises(RuntimeError, match="re-check"):
        binding.install([fake_ddp(group)], config="cfg", make_gather=FakeGather)
    assert FakeGather.log == [] and not upstream.is_attached(group)


def test_define_missing_te_names_binds_only_a_missing_name(monkeypatch):
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    upstream.define_missing_te_names()
    assert moe_utils.te_general_gemm is None
    sentinel = object()
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel)
    upstream.define_missing_te_names()
    assert moe_utils.te_general_gemm is sentinel
