"""The demo model family pipeline: corpus -> tokenizer -> target -> distilled drafts -> measurements.

specfleet must run on a fresh machine with no model hub, so it ships a small model family it
makes itself from material every Python install has (the standard library's source and its
English docs). ``python -m training all`` (``make demo-models``) rebuilds it reproducibly on a
CPU; every stage checkpoints under ``.specfleet/training/`` so re-running continues.
"""
