"""The registry knows every kind a manifest may name, and what the rest of the package asks."""

from __future__ import annotations

import typing

import pytest

from memspec.drafts.manifest import DraftManifest, ManifestError, load_manifest
from memspec.drafts.registry import KINDS, PRIOR_ALPHA, UNKNOWN_KIND, draft_kind


def test_every_manifest_kind_is_registered():
    kinds = set(typing.get_args(DraftManifest.model_fields["kind"].annotation))
    assert kinds == set(KINDS) == set(PRIOR_ALPHA)
    assert draft_kind("no-such-kind") is UNKNOWN_KIND


def test_a_kind_with_a_file_needs_one_named(tmp_path):
    for name, kind in KINDS.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(f'id = "d-{name.replace("_", "-")}"\nkind = "{name}"\n')
        if kind.has_file:
            with pytest.raises(ManifestError, match="required for kind"):
                load_manifest(path)
        else:
            assert load_manifest(path).kind == name
