"""The Triton gated delta rule over the tree (kernels/delta_triton.py) on the CPU, through
Triton's interpreter (skipped where triton does not import): close to the torch path
(kernels/delta_tree.py, chunked) and to a token-by-token reference in fp64, a document's rows
bit-identical alone vs packed and a question's alone vs beside other questions; and both
kernels compile for sm_90 (no GPU needed)."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from spinf_worker.engine.layout import Branch, DocTree, FlatDoc
from spinf_worker.engine.runner import doc_span
from spinf_worker.kernels import delta_tree
from spinf_worker.kernels.attention import AttentionPlan

from .conftest import triton_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

HEADS, DK, DV = 2, 16, 16
VOCAB = 512


def interpreted(check: str) -> None:
    """``check`` under the interpreter, roots of 256 rows or more by chunks (off by
    default: not yet fast on a GPU)."""
    triton_interpreted(__name__, check, env={"SPINF_DELTA_CHUNKED_ROOT": "256"})


def interpreted_rule():
    """delta_triton.tree_delta_rule, its kernels run by the interpreter on CPU tensors."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from spinf_worker.kernels.delta_triton import tree_delta_rule

    return tree_delta_rule


def random_doc(rng: random.Random, root: int, branches: int, deep: int = 9) -> FlatDoc:
    """BOS and ``root`` content tokens; questions from a few tokens, so their paths share
    prefixes, up to ``deep`` of them, and 1-3 options of 1-3 tokens."""
    return DocTree([2] + [rng.randrange(40, VOCAB) for _ in range(root)],
                   [Branch([rng.choice((17, 18, 19)) for _ in range(rng.randint(0, deep))],
                           [[rng.randrange(20, 40) for _ in range(rng.randint(1, 3))]
                            for _ in range(rng.randint(1, 3))]) for _ in range(branches)]
                   ).flatten(0)


def pass_of(docs: list[FlatDoc], device="cpu") -> tuple[AttentionPlan, torch.Tensor]:
    """The plan of ``docs`` packed one after another, and the pass's token ids."""
    starts = [sum(d.length for d in docs[:i]) for i in range(len(docs))]
    plan = AttentionPlan([doc_span(d, s, 1 << 30, torch.device(device))
                          for d, s in zip(docs, starts, strict=True)])
    return plan, torch.cat([d.input_ids for d in docs])


def features(ids: torch.Tensor, heads: int = HEADS, dk: int = DK, dv: int = DV,
             device="cpu") -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta of each row from its token alone (a row of the same token, anywhere,
    gets the same ones), as the DeltaNet layer hands them over: q and k l2-normalised, q
    scaled by dk^-0.5, g a log decay (decays over a few to a few hundred rows), fp32."""
    gen = torch.Generator().manual_seed(dk)
    table = torch.randn(VOCAB, heads, 2 * dk + dv + 2, generator=gen)
    x = table[ids.cpu()].to(device)
    q, k, v, a, b = x.split([dk, dk, dv, 1, 1], dim=-1)
    q = F.normalize(q, dim=-1) * dk ** -0.5
    k = F.normalize(k, dim=-1)
    g = -torch.exp(torch.linspace(-5.0, 0.0, heads, device=device)) * F.softplus(a[..., 0])
    return q, k, v, g, b[..., 0].sigmoid()


def recurrent(q, k, v, g, beta, state):
    """The rule token by token (transformers' torch_recurrent_gated_delta_rule): rows [T, H,
    ...], state [H, dk, dv] -> out [T, H, dv], the state after the last row."""
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append((state * q[t][:, :, None]).sum(1))
    return torch.stack(out), state


def reference(docs: list[FlatDoc], q, k, v, g, beta) -> torch.Tensor:
    """Each root from a zero state, each branch row from its root's state along its own path
    (FlatDoc.paths, not the tiles the kernels read), in fp64."""
    q, k, v, g, beta = (x.double().cpu() for x in (q, k, v, g, beta))
    out = torch.zeros_like(v)
    start = 0
    for doc in docs:
        root = slice(start, start + doc.root)
        zero = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
        out[root], state = recurrent(q[root], k[root], v[root], g[root], beta[root], zero)
        rows, ok = doc.paths
        for j in range(doc.tokens - doc.root):
            path = rows[j][ok[j]] + start
            o, _ = recurrent(q[path], k[path], v[path], g[path], beta[path], state)
            out[start + doc.root + j] = o[-1]
        start += doc.length
    return out


def branch_keys(docs: list[FlatDoc], ids: torch.Tensor) -> list[dict[tuple, int]]:
    """Per document, its branch rows by their path's tokens -> pass row."""
    keys, start = [], 0
    for doc in docs:
        rows, ok = doc.paths
        keys.append({tuple(ids[start + rows[j][ok[j]]].tolist()): start + doc.root + j
                     for j in range(doc.tokens - doc.root)})
        start += doc.length
    return keys


def test_close_to_torch_path_and_to_token_by_token():
    """Roots of 1 to 70 rows (one over a 64-row chunk of the torch path) token by token, of
    257 and 301 rows by chunks, questions up to 14 tokens deep, one 24 deep (its path pads
    to 32)."""
    interpreted("check_close")


def test_document_bits_alone_vs_packed():
    interpreted("check_document_bits")


def test_question_bits_alone_vs_beside_others():
    """A question's rows alone under its root and beside other questions, some sharing its
    first tokens, some deeper (their paths pad to other widths)."""
    interpreted("check_question_bits")


def check_close():
    from spinf_worker.kernels.delta_triton import CHUNKED_ROOT

    rule = interpreted_rule()
    rng = random.Random(0)
    docs = [random_doc(rng, n, 3) for n in (0, 4, 37, 69, CHUNKED_ROOT, 300)]
    docs.append(DocTree([2, 41, 42], [Branch([18] * 22, [[21, 22]])]).flatten(0))
    plan, ids = pass_of(docs)
    inputs = features(ids)
    got = rule(plan, *inputs)
    torch_path = delta_tree.tree_delta_rule(plan, *inputs)
    want = reference(docs, *inputs)
    vs_torch = float((got - torch_path).abs().max())
    vs_ref = float((got.double() - want).abs().max())
    torch_vs_ref = float((torch_path.double() - want).abs().max())
    print(f"delta_triton (interpreted) max |Δ|: vs the torch path {vs_torch:.2e}, vs "
          f"token by token in fp64 {vs_ref:.2e} (torch path vs fp64 {torch_vs_ref:.2e}); "
          f"outputs up to {float(want.abs().max()):.2f}")
    assert vs_torch < 2e-5 and vs_ref < 2e-5
    # padding rows stay zeros; every real row was written
    pad = torch.ones(ids.shape[0], dtype=torch.bool)
    start = 0
    for doc in docs:
        pad[start:start + doc.tokens] = False
        start += doc.length
    assert not got[pad].any() and got[~pad].abs().sum(-1).gt(0).all()


def check_document_bits():
    """A short root (token by token) and a long one (by chunks), each alone and among
    others, short and long."""
    rule = interpreted_rule()
    rng = random.Random(1)
    others = [random_doc(rng, rng.randint(0, 12), 1) for _ in range(3)]
    others.insert(2, random_doc(rng, 280, 1))
    for target in (random_doc(rng, 21, 2), random_doc(rng, 330, 2)):
        plan, ids = pass_of([target])
        alone = rule(plan, *features(ids))
        for at in (1, 4):
            docs = others[:at] + [target] + others[at:]
            plan, ids = pass_of(docs)
            start = sum(d.length for d in docs[:at])
            packed = rule(plan, *features(ids))
            assert torch.equal(packed[start:start + target.length], alone), at


def check_question_bits():
    rule = interpreted_rule()
    root = [2] + list(range(100, 112))
    question = Branch([17, 18, 19], [[21], [22, 23]])
    others = [Branch([17, 18], [[24]]), Branch([17] * 9, [[25, 26]]), Branch([19], [[21]]),
              Branch([18] * 7, [[27]])]
    alone_doc = DocTree(root, [question]).flatten(0)
    plan, ids = pass_of([alone_doc])
    alone = rule(plan, *features(ids))
    [alone_rows] = branch_keys([alone_doc], ids)
    for at in (0, 2, 4):
        doc = DocTree(root, others[:at] + [question] + others[at:]).flatten(0)
        plan, ids = pass_of([doc])
        out = rule(plan, *features(ids))
        [rows] = branch_keys([doc], ids)
        for key, row in alone_rows.items():
            assert torch.equal(out[rows[key]], alone[row]), (at, key)
        assert torch.equal(out[:doc.root], alone[:doc.root])


def test_only_leaves_run_their_paths():
    """The branch programs that run are the leaves' (rows on no other row's path), each over
    its whole path; together they cover every branch row."""
    from spinf_worker.kernels.delta_triton import TreeRows

    rng = random.Random(3)
    docs = [random_doc(rng, 9, 6), random_doc(rng, 0, 4)]
    plan, _ = pass_of(docs)
    tree = TreeRows.of(plan, "cpu")
    runs = {tuple(p[:n].tolist()) for p, n in zip(tree.path, tree.path_len, strict=True) if n}
    paths = paths_of(docs)
    inner = {r for p in paths for r in p[:-1]}
    assert runs == {p for p in paths if p[-1] not in inner} and len(runs) < len(paths)
    assert {r for p in runs for r in p} == {p[-1] for p in paths}


def paths_of(docs: list[FlatDoc]) -> list[tuple[int, ...]]:
    """Every branch row's path, as pass rows."""
    out, start = [], 0
    for doc in docs:
        rows, ok = doc.paths
        out += [tuple((rows[j][ok[j]] + start).tolist()) for j in range(doc.tokens - doc.root)]
        start += doc.length
    return out


def test_cpu_keeps_the_torch_path(monkeypatch):
    """On CPU tensors tree_delta_rule never reaches for Triton."""
    def refuse():
        raise AssertionError("the Triton path on the CPU")

    monkeypatch.setattr(delta_tree, "_triton_rule", refuse)
    rng = random.Random(2)
    plan, ids = pass_of([random_doc(rng, 5, 2)])
    delta_tree.tree_delta_rule(plan, *features(ids))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="kernels interpreted")
def test_kernels_compile_for_sm90(tmp_path):
    """The compiled path, which the interpreter does not check: every kernel down to a cubin
    for sm_90 at the 27B's head sizes, without a GPU (triton's bundled ptxas)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from spinf_worker.kernels import delta_triton as dt

    tensors = {name: "*fp32" for name in ("q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr",
                                           "out_ptr", "state_ptr")}
    chunked = {"u_ptr": "*fp32", "w_ptr": "*fp32"}
    heads = {"H": 48, "DK": 128, "DV": 128, "BK": 128}
    kernels = [(dt._root_kernel, {"start_ptr": "*i64", "len_ptr": "*i32", "docs_ptr": "*i32"},
                {"BV": dt.ROOT_BV}, dt.ROOT_WARPS),
               (dt._branch_kernel, {"doc_ptr": "*i32", "path_ptr": "*i64",
                                    "len_ptr": "*i32", "width": "i32"}, {"BV": dt.BRANCH_BV},
                dt.BRANCH_WARPS),
               (dt._chunk_solve_kernel, {**chunked, "start_ptr": "*i64", "len_ptr": "*i32",
                                         "chunk_doc_ptr": "*i32", "chunk_at_ptr": "*i32"},
                {"BDV": 128, "C": dt.CHUNK}, dt.SOLVE_WARPS),
               (dt._chunk_state_kernel, {**chunked, "start_ptr": "*i64", "len_ptr": "*i32",
                                         "first_chunk_ptr": "*i32", "docs_ptr": "*i32"},
                {"BV": dt.CHUNK_BV, "C": dt.CHUNK}, dt.CHUNK_WARPS)]
    for kernel, pointers, sizes, warps in kernels:
        consts = {**heads, **sizes}
        params = kernel.arg_names
        args = {**tensors, **pointers, **dict.fromkeys(consts, "constexpr")}
        signature = {name: args[name] for name in params}
        names = list(signature)
        source = ASTSource(kernel, signature,
                           constexprs={(names.index(n),): v for n, v in consts.items()})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        assert compiled.asm["cubin"]
        # spills: a thread's stack (fp32 "ieee" products spilled 19-25 KiB and ran ~59x
        # slower than the token-by-token scan)
        cubin = tmp_path / f"{kernel.__name__}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump",
                                "-res-usage", cubin], capture_output=True, text=True).stdout
        stack = int(re.search(r"STACK:(\d+)", usage)[1])
        assert stack <= 4096, (kernel.__name__, usage)
