"""A head's own trees (``HEAD_DIR/trees.json``) as users reach them: ``generate(tree=N)``, the
step API, ``specengine generate --tree N`` and ``specengine serve --tree N`` with the
``openai`` client. Each request verifies the tree of its kind (greedy or sampled).

The head is a copy of the bundled one with a hand-written ``trees.json`` whose two kinds
differ in shape, so which one a request verified shows in its counts: the greedy tree of 4
drafts is 3 deep (a chain of 3 and one sibling), the sampled one is 1 deep (four siblings),
so a sampled request can keep at most one draft per step."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.cli import main as cli_main
from specengine.drafters.head_trees import TREES_FILE, HeadTrees, load_head_trees
from specengine.tree import DraftTree, TreeChoice

PROMPTS = [[17, 16, 6, 9, 4, 12, 5, 10, 7, 14], [17, 11, 4, 6, 5, 12, 9, 9, 13, 14]]
GREEDY4 = [[0], [0, 0], [0, 0, 0], [1]]
SAMPLED4 = [[0], [1], [2], [3]]
TREES = {"greedy": {"2": [[0], [0, 0]], "4": GREEDY4},
         "sampled": {"2": [[0], [1]], "4": SAMPLED4, "8": [[i] for i in range(8)]}}


def write_head(dst: Path, trees: object = TREES) -> Path:
    shutil.copytree(DEFAULT_DRAFT, dst)
    (dst / TREES_FILE).write_text(json.dumps({"depth": 3, "trees": trees}))
    return dst


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_head(tmp_path_factory.mktemp("heads") / "with-trees")


@pytest.fixture(scope="module")
def engine(head: Path) -> Iterator[SpecEngine]:
    eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", kernel_backend="torch",
                     max_batch_size=16, kv_cache_tokens=8 * 1024)
    yield eng
    eng.close()


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def sampled(seed: int, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)


def verify_steps(out: object) -> int:
    return out.num_steps - 1  # the first step is the prefill, which verifies nothing


def assert_idle(eng: SpecEngine) -> None:
    assert not eng.has_unfinished()
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks
    assert eng.drafter.kv_cache.num_free_blocks == eng.drafter.kv_cache.num_blocks


# ---- the file ------------------------------------------------------------------------------
def test_head_trees_reads_both_kinds_by_size(head: Path) -> None:
    trees = HeadTrees.load(head)
    assert trees.sizes == (2, 4)  # 8 has no greedy tree: not offered
    choice = trees.choice(4)
    assert choice.greedy.paths == DraftTree(GREEDY4).paths
    assert choice.sampled.paths == DraftTree(SAMPLED4).paths
    assert choice.for_request(greedy=True) is choice.greedy
    assert choice.for_request(greedy=False) is choice.sampled
    assert (choice.max_depth, choice.num_nodes) == (3, 5)
    assert trees.paths("sampled", 8) == [(i,) for i in range(8)]
    assert load_head_trees(DEFAULT_DRAFT) is None  # no file: no trees
    assert load_head_trees("suffix") is None and load_head_trees(None) is None


@pytest.mark.parametrize(("trees", "match"), [
    ({"greedy": {"2": [[0], [0, 0]]}}, "must have the kinds"),
    ({"greedy": {}, "sampled": {}, "beam": {}}, "holds kinds"),
    ({"greedy": {"2": [[0], [1, 0]]}, "sampled": {}}, "not prefix-closed"),
    ({"greedy": {"3": [[0], [1]]}, "sampled": {}}, "has 2 paths"),
    ({"greedy": {"two": [[0], [1]]}, "sampled": {}}, "key must be its number of drafts"),
    ({"greedy": {"2": [0, 1]}, "sampled": {}}, "list of paths"),
    ({"greedy": {"2": [["a"], [1]]}, "sampled": {}}, "the greedy tree of '2' drafts"),
    ([1, 2], "no 'trees' object"),
])
def test_a_malformed_trees_file_is_refused_when_the_engine_loads_it(
        tmp_path: Path, trees: object, match: str) -> None:
    bad = write_head(tmp_path / "bad", trees)
    with pytest.raises(ValueError, match=match):
        HeadTrees.load(bad)
    with pytest.raises(ValueError, match="trees.json"):  # at construction, not in a step
        SpecEngine(DEFAULT_TARGET, draft=bad, device="cpu", kernel_backend="torch")


def test_trees_file_that_is_not_json(tmp_path: Path) -> None:
    bad = write_head(tmp_path / "bad")
    (bad / TREES_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        HeadTrees.load(bad)


def test_tree_choice_checks_its_sizes() -> None:
    with pytest.raises(ValueError, match="greedy has 2 drafts, not num_drafts=4"):
        TreeChoice(DraftTree([[0], [1]]), DraftTree(SAMPLED4), 4)
    with pytest.raises(ValueError, match="must be a DraftTree"):
        TreeChoice(DraftTree(GREEDY4), SAMPLED4, 4)  # type: ignore[arg-type]


# ---- generate(tree=N) ----------------------------------------------------------------------
def test_each_request_verifies_the_tree_of_its_kind(engine: SpecEngine) -> None:
    params = [greedy(), sampled(7)]
    outs = engine.generate(PROMPTS, tree=4, sampling=params)
    g, s = outs
    # greedy: lossless, and the 3-deep greedy tree (4 drafts a step) keeps more than one
    # draft a step on average, which the 1-deep sampled tree never could
    assert g.token_ids == engine.generate(PROMPTS[:1], k=0, sampling=greedy())[0].token_ids
    assert g.num_draft_tokens == 4 * verify_steps(g)
    assert g.num_accepted_tokens > verify_steps(g)
    # sampled: the sampled tree, token for token as its paths give it, at most one per step
    want = engine.generate(PROMPTS[1:], tree=SAMPLED4, sampling=sampled(7))[0]
    assert s.token_ids == want.token_ids  # (logprobs: to the rounding of another batch)
    assert s.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert s.num_draft_tokens == 4 * verify_steps(s)
    assert 0 < s.num_accepted_tokens <= verify_steps(s)
    # the same call with k given as the depth: the same tokens
    again = engine.generate(PROMPTS, k=3, tree=4, sampling=[greedy(), sampled(7)])
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert_idle(engine)


def test_the_greedy_tree_is_the_greedy_requests_own(engine: SpecEngine) -> None:
    out = engine.generate(PROMPTS[:1], tree=4, sampling=greedy())[0]
    want = engine.generate(PROMPTS[:1], tree=GREEDY4, sampling=greedy())[0]
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (
        want.num_draft_tokens, want.num_accepted_tokens)
    chain = engine.generate(PROMPTS[:1], tree=2, sampling=greedy())[0]  # [[0], [0, 0]]
    assert chain.token_ids == out.token_ids and chain.num_draft_tokens == 2 * verify_steps(chain)


def test_step_api_and_async_engine_take_a_tree_size(head: Path) -> None:
    eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", kernel_backend="torch",
                     max_batch_size=16, kv_cache_tokens=8 * 1024)
    base = eng.generate(PROMPTS, k=0, sampling=greedy())
    rid = eng.add_request(PROMPTS[0], greedy(), tree=4)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.output is not None:
                done[out.request_id] = out.output
    assert done[rid].token_ids == base[0].token_ids
    assert done[rid].num_draft_tokens == 4 * verify_steps(done[rid])

    aeng = AsyncSpecEngine(eng)
    try:
        out = asyncio.run(aeng.generate(PROMPTS[1], greedy(), tree=4))
        assert out.token_ids == base[1].token_ids
        assert out.num_draft_tokens == 4 * verify_steps(out)
    finally:
        asyncio.run(aeng.close())


@pytest.mark.parametrize(("kw", "match"), [
    ({"tree": 5}, r"has trees of \[2, 4\] drafts"),
    ({"tree": 8}, r"has trees of \[2, 4\] drafts"),  # a sampled tree only
    ({"tree": True}, "tree must be a list of paths"),
    ({"tree": "4"}, "tree must be a list of paths"),
    ({"tree": [[0], 5]}, "each path must be a list of int ranks"),  # (was a TypeError)
    ({"tree": 4, "k": 2}, "k=2 disagrees with the depth 3 of the draft's trees of 4"),
    ({"tree": 4, "k": "auto"}, "takes no tree"),
])
def test_bad_tree_sizes_are_refused_and_nothing_runs(engine: SpecEngine, kw: dict,
                                                     match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine.generate(PROMPTS, sampling=greedy(), **kw)
    with pytest.raises(ValueError, match=match):
        engine.add_request(PROMPTS[0], greedy(), **kw)
    assert_idle(engine)


def test_k_is_the_deeper_trees_depth_and_each_tree_keeps_its_own(engine: SpecEngine) -> None:
    # the sampled tree is 1 deep, the greedy one 3: k=1 is refused even for sampled requests
    with pytest.raises(ValueError, match="k=1 disagrees with the depth 3 of the draft's trees"):
        engine.generate(PROMPTS, k=1, tree=4, sampling=sampled(1))
    outs = engine.generate(PROMPTS, k=3, tree=4, sampling=sampled(1))
    assert all(0 < o.num_accepted_tokens <= verify_steps(o) for o in outs)  # still 1 deep
    assert all(o.num_draft_tokens == 4 * verify_steps(o) for o in outs)
    assert_idle(engine)


def test_a_tree_on_the_cpu_warns_once_that_it_is_slower(head: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", kernel_backend="torch",
                     max_batch_size=8, kv_cache_tokens=4 * 1024)
    with caplog.at_level("WARNING", logger="specengine.engine"):
        eng.generate(PROMPTS, tree=4, sampling=greedy(4))
        eng.generate(PROMPTS, tree=2, sampling=greedy(4))
    said = [r.getMessage() for r in caplog.records if "slower than k=0" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("tree=4 verifies 5 positions per sequence")
    eng.close()


def test_a_draft_without_trees_names_the_file() -> None:
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                     max_batch_size=8, kv_cache_tokens=4 * 1024)
    with pytest.raises(ValueError, match="has no trees.json: pass the tree's paths"):
        eng.generate(PROMPTS, tree=4, sampling=greedy())
    assert eng.draft_trees is None
    assert not eng.has_unfinished()
    eng.close()


def test_a_pool_worker_verifies_the_trees_its_first_worker_chose(head: Path) -> None:
    """``RolloutPool.generate(tree=4)``'s path without Ray: worker 0 validates (the int
    becomes the head's TreeChoice), the checked call travels pickled (as Ray sends it) and
    each worker verifies it."""
    import pickle

    from specengine.distributed.worker import RolloutWorker

    kw = {"device": "cpu", "kernel_backend": "torch", "max_batch_size": 8,
          "kv_cache_tokens": 4 * 1024}
    first, other = (RolloutWorker(i, DEFAULT_TARGET, head, kw) for i in range(2))
    params = [greedy(), sampled(3)]
    req = pickle.loads(pickle.dumps(first.validate(PROMPTS, 0, params, 4)))
    assert isinstance(req.tree, TreeChoice) and req.k == 3
    outs, _ = other.generate(req.prompts, req.k, list(req.params), req.tree)
    want = other.engine.generate(PROMPTS, tree=4, sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert outs[1].num_accepted_tokens <= verify_steps(outs[1])  # the 1-deep sampled tree


def test_a_draft_loaded_from_a_head_dir_brings_its_trees(head: Path, tmp_path: Path) -> None:
    """``load_weights(dir, which="draft")`` and the server's staged load: a head dir with
    trees.json replaces the trees ``tree=N`` verifies; a bad file refuses the whole update."""
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                     max_batch_size=8, kv_cache_tokens=4 * 1024)
    assert eng.draft_trees is None
    bad = write_head(tmp_path / "bad", {"greedy": {"2": [[0], [1, 0]]}, "sampled": {}})
    with pytest.raises(ValueError, match="not prefix-closed"):
        eng.load_weights(bad, which="draft")
    assert eng.weight_version == 0 and eng.draft_trees is None  # nothing applied
    assert eng.load_weights(head, which="draft") == 1
    assert eng.draft_trees is not None and eng.draft_trees.sizes == (2, 4)
    out = eng.generate(PROMPTS[:1], tree=4, sampling=greedy())[0]
    assert out.num_draft_tokens == 4 * verify_steps(out)
    other = write_head(tmp_path / "other", {"greedy": {"3": [[0], [1], [2]]},
                                            "sampled": {"3": [[0], [1], [2]]}})
    eng.commit_staged(eng.stage_weights(other, which="draft"))  # the server's path
    assert eng.draft_trees.sizes == (3,) and eng.weight_version == 2
    eng.load_weights(DEFAULT_DRAFT, which="draft")  # no trees.json there: the trees stay
    assert eng.draft_trees.sizes == (3,)
    eng.load_weights(DEFAULT_TARGET)  # the policy's weights never touch them
    assert eng.draft_trees.sizes == (3,)
    eng.close()


# ---- the command line ----------------------------------------------------------------------
def test_cli_generate_with_a_tree(head: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = " ".join(map(str, PROMPTS[0]))
    assert cli_main(["generate", "--model", str(DEFAULT_TARGET), "--draft", str(head),
                     "--tree", "4", "--prompt-ids", ids, "--max-tokens", "16",
                     "--device", "cpu", "--kernel-backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "[tree=4]" in out and "acceptance rate per draft position" in out
    assert "[k=0] identical completions: 1/1" in out  # the baseline ran and matched


def run_cli(argv: list[str]) -> int:
    try:
        return cli_main(argv)
    except SystemExit as e:  # argparse's own refusals
        return int(e.code)


@pytest.mark.parametrize(("args", "match"), [
    (["--tree", "4", "--k", "auto"], "--tree 4 verifies a static tree .* --k auto"),
    (["--tree", "4", "--draft", "ngram"], "give --draft HEAD_DIR"),
    (["--tree", "4"], "give --draft HEAD_DIR"),
    (["--tree", "0"], "must be >= 1"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_tree_flag_combinations(command: str, args: list[str], match: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli([command, "--model", str(DEFAULT_TARGET), *args]) == 2
    assert re.search(match, capsys.readouterr().err)


# ---- specengine serve --tree N -------------------------------------------------------------
def test_serve_tree_through_the_openai_client_and_the_native_route(head: Path) -> None:
    """``make_server(default_tree=4)`` (what ``serve --tree 4`` builds): a request that gives
    no k verifies the draft's tree of its kind; one that gives k drafts a chain of k."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from server_helpers import WAIT_S, assert_idle_and_free, in_engine, post_json, running_server

    eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", kernel_backend="torch",
                     max_batch_size=16, kv_cache_tokens=8 * 1024)
    aeng = AsyncSpecEngine(eng)
    try:
        base = eng.generate(PROMPTS[:1], k=0, sampling=greedy(40))[0]
        want = eng.generate(PROMPTS[:1], tree=SAMPLED4, sampling=sampled(5, 40))[0]
        chain3 = eng.generate(PROMPTS[:1], k=3, sampling=greedy(40))[0]
        with running_server(aeng, default_k=3, default_tree=4) as (server, client):
            oai = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                                max_retries=0, timeout=WAIT_S)
            model = oai.models.list().data[0].id
            c = oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40,
                                       temperature=0, extra_body={"return_token_ids": True})
            (choice,) = c.choices
            assert choice.token_ids == list(base.token_ids)
            assert choice.num_draft_tokens == 4 * (choice.num_steps - 1)  # the tree
            assert choice.num_accepted_tokens > choice.num_steps - 1  # the 3-deep greedy one
            s = oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40,
                                       temperature=1, seed=5,
                                       extra_body={"return_token_ids": True})
            assert s.choices[0].token_ids == list(want.token_ids)  # the sampled tree
            chain = oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=40,
                                           temperature=0, extra_body={"k": 2})
            assert chain.choices[0].text == choice.text
            assert chain.choices[0].num_draft_tokens == 2 * (chain.choices[0].num_steps - 1)
            native = client.generate(PROMPTS[0], greedy(40))  # POST /generate, no k
            assert native.token_ids == base.token_ids
            assert native.num_draft_tokens == 4 * (native.num_steps - 1)
            status, sgl = post_json(server.port, "/generate", {  # SGLang's body, no k
                "input_ids": PROMPTS[0], "sampling_params": {"temperature": 0,
                                                             "max_new_tokens": 40}})
            assert status == 200 and sgl["output_ids"] == list(base.token_ids)
            # (SGLang's meta_info has no step count: the tree's drafts are the native ones,
            # and not what a chain of the server's k=3 would have proposed)
            assert sgl["meta_info"]["num_draft_tokens"] == native.num_draft_tokens
            assert sgl["meta_info"]["num_draft_tokens"] != chain3.num_draft_tokens
            in_engine(aeng, assert_idle_and_free)
    finally:
        asyncio.run(aeng.close())


def test_specengine_serve_tree_flag_reaches_the_server(head: Path) -> None:
    """``specengine serve --draft HEAD --tree 4`` as a process: a request that gives no k
    verifies the tree (4 drafts a step), one that gives k=2 a chain of 2."""
    pytest.importorskip("fastapi")
    from sglang_helpers import serve_process

    from specengine.client import SpecEngineClient

    with serve_process("--draft", str(head), "--tree", "4") as (_proc, port, log):
        client = SpecEngineClient(f"http://127.0.0.1:{port}", timeout=120)
        out = client.generate(PROMPTS[0], greedy(24))
        assert out.num_draft_tokens == 4 * verify_steps(out), "".join(log)
        chain = client.generate(PROMPTS[0], greedy(24), k=2)
        assert chain.token_ids == out.token_ids
        # (a chain near max_tokens proposes fewer drafts: at most 2 a step, never the tree's 4)
        assert 0 < chain.num_draft_tokens <= 2 * verify_steps(chain)


@pytest.mark.parametrize(("options", "match"), [
    ({"default_tree": 5}, r"has trees of \[2, 4\] drafts"),
    ({"default_tree": 4, "default_k": "auto"}, "takes no default_tree"),
    ({"default_tree": 4, "default_k": 2}, "default_k=2 disagrees with the depth 3"),
])
def test_serve_refuses_a_tree_it_cannot_verify(head: Path, options: dict, match: str) -> None:
    pytest.importorskip("fastapi")
    from specengine.server.app import build_app

    eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", kernel_backend="torch",
                     max_batch_size=8, kv_cache_tokens=4 * 1024)
    aeng = AsyncSpecEngine(eng)
    try:
        with pytest.raises(ValueError, match=match):
            build_app(aeng, **options)
    finally:
        asyncio.run(aeng.close())
