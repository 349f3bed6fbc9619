"""Blocks of two sizes as pages of the smaller: whether two block sizes pair, and
block ids as page ids and back (kvpush.layout maps a page's bytes)."""

from __future__ import annotations


def block_size_problem(
    src_tokens: int, dst_tokens: int, src_pages: bool = True, dst_pages: bool = True
) -> str | None:
    """Why a producer of `src_tokens` tokens per block cannot fill a consumer's blocks
    of `dst_tokens`, or None. Pairable: one size divides the other, so that every
    larger block is a whole number of the smaller ones, and both caches can be cut
    into pages (`*_pages`: a side's blocks hold their tokens in a known order)."""
    if max(src_tokens, dst_tokens) % min(src_tokens, dst_tokens):
        return (
            f"block sizes differ: prefill holds {src_tokens} tokens per block, decode "
            f"{dst_tokens}; kvpush pairs block sizes only where one divides the other "
            "(a larger block must be whole pages of the smaller)"
        )
    if src_tokens != dst_tokens and not (src_pages and dst_pages):
        which = "prefill's" if not src_pages else "decode's"
        return (
            f"block sizes differ: prefill holds {src_tokens} tokens per block, decode "
            f"{dst_tokens}, and {which} KV cache keeps its tokens in its attention "
            "kernel's own order (vLLM's CPU build), so a page of another block size is "
            "not a slice of it; start both with the same --block-size"
        )
    return None


def page_factors(local_tokens: int, remote_tokens: int) -> tuple[int, int]:
    """Pages per block on each side of a pair (the page: the smaller block size)."""
    page = min(local_tokens, remote_tokens)
    return local_tokens // page, remote_tokens // page


def to_pages(block_ids: list[int], pages: int) -> list[int]:
    """Block ids as page ids, `pages` pages a block, in order."""
    if pages == 1:
        return list(block_ids)
    return [b * pages + j for b in block_ids for j in range(pages)]


def blocks_of(page_ids: list[int], pages: int) -> list[int]:
    """The blocks that hold these pages, in order of first appearance."""
    if pages == 1:
        return list(page_ids)
    return list(dict.fromkeys(p // pages for p in page_ids))
