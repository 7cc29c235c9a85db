"""The storage layer's tests that run on a remote store (tests/unit/test_storage_layer.py, there on
fsspec's in-memory filesystem), here against S3 itself: a moto server on 127.0.0.1. The same test
functions, with their `remote` store an S3 prefix: the mirror's parts of whole lines, the copy-down,
coalesced puts, a failing store, torn and manifest-less checkpoints, the zombie incarnation fenced off,
the old layout read back."""
from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path

import pytest

from actors.runs.storage import open_storage

pytest.importorskip("moto.server", reason="the S3 tests need moto[server] (the test extra)")
_spec = importlib.util.spec_from_file_location(
    "storage_layer_unit", Path(__file__).resolve().parents[1] / "unit" / "test_storage_layer.py")
layer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layer)


@pytest.fixture
def remote(s3):
    storage = open_storage(s3.format(prefix=f"layer-{uuid.uuid4().hex[:8]}"))
    assert storage.remote and storage.scheme == "s3"
    return storage


test_appended_files_go_up_as_parts_of_whole_lines_that_read_back_byte_for_byte = \
    layer.test_appended_files_go_up_as_parts_of_whole_lines_that_read_back_byte_for_byte
test_a_new_mirror_sends_only_what_the_store_lacks_and_a_hole_ends_the_read = \
    layer.test_a_new_mirror_sends_only_what_the_store_lacks_and_a_hole_ends_the_read
test_hydrate_copies_down_what_this_nodes_folder_lacks = layer.test_hydrate_copies_down_what_this_nodes_folder_lacks
test_puts_are_coalesced_newest_wins = layer.test_puts_are_coalesced_newest_wins
test_a_torn_checkpoint_object_is_skipped_with_a_warning = layer.test_a_torn_checkpoint_object_is_skipped_with_a_warning
test_a_checkpoint_without_its_manifest_does_not_count = layer.test_a_checkpoint_without_its_manifest_does_not_count
test_a_zombie_incarnation_neither_spoils_the_live_copy_nor_writes_once_it_sees_the_newer_claim = \
    layer.test_a_zombie_incarnation_neither_spoils_the_live_copy_nor_writes_once_it_sees_the_newer_claim
test_a_run_mirrored_in_the_old_layout_reads_back_and_a_restart_carries_on_after_it = \
    layer.test_a_run_mirrored_in_the_old_layout_reads_back_and_a_restart_carries_on_after_it
test_a_part_holds_whole_lines_even_past_its_size = layer.test_a_part_holds_whole_lines_even_past_its_size
