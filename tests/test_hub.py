"""Models by Hugging Face Hub id (griffin.hub), against a Hub cache built here and a Hub server on this machine: no
network is used.

The cache is written in the layout huggingface_hub writes (``models--org--name/refs/<ref>`` holding a commit,
``snapshots/<commit>/<file>`` links into ``blobs/``) and checked with huggingface_hub's own cache scanner. The server
answers the few routes ``snapshot_download`` calls (revision, file tree, file) from local folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants
from safetensors.torch import save_file

from griffin import DraftModel, SpecGenerator, load_target
from griffin.draft_lm import load_draft_lm
from griffin.hub import hub_id, resolve
from griffin.official import read_official_state
from griffin.target import load_target_head
from tests.conftest import ROOT, run_main, run_module, tiny_model

TARGET, HEAD, STUDENT = "tiny-org/tiny-llama", "tiny-org/tiny-llama-griffin", "tiny-org/tiny-student"
OFFICIAL_GRIFFIN, OFFICIAL_EAGLE = "official-org/griffin-head", "official-org/eagle-head"
FIXTURES = ROOT / "tests" / "fixtures"
MISSING = "nobody/not-cached"


def commit_of(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()  # a commit hash is 40 hex digits


def put_in_cache(cache: Path, repo: str, folder: Path, ref: str = "main") -> None:
    """Store ``folder``'s files as revision ``ref`` of model ``repo`` in the Hub cache at ``cache`` (its commit:
    ``commit_of("repo@ref")``)."""
    commit = commit_of(f"{repo}@{ref}")
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / ref).write_text(commit)
    snapshot = storage / "snapshots" / commit
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_target_dir, head_dir, smol_tokenizer) -> Path:
    """A Hub cache with the tiny target (SmolLM2's tokenizer), its random head, a one-layer draft LM, two official
    head checkpoints (GRIFFIN in safetensors, EAGLE as pytorch_model.bin like the official repositories) and a tag."""
    cache = tmp_path_factory.mktemp("hub-cache")
    put_in_cache(cache, TARGET, tiny_target_dir)
    put_in_cache(cache, HEAD, head_dir)
    student = tmp_path_factory.mktemp("student")
    tiny_model("llama", vocab_size=len(smol_tokenizer), hidden=32, layers=1, seed=1).save_pretrained(student)
    smol_tokenizer.save_pretrained(student)
    put_in_cache(cache, STUDENT, student)
    put_in_cache(cache, OFFICIAL_GRIFFIN, FIXTURES / "official-griffin")
    eagle = tmp_path_factory.mktemp("official-eagle")
    shutil.copyfile(FIXTURES / "official-eagle" / "config.json", eagle / "config.json")
    torch.save(read_official_state(FIXTURES / "official-eagle"), eagle / "pytorch_model.bin")
    put_in_cache(cache, OFFICIAL_EAGLE, eagle)
    other = tmp_path_factory.mktemp("other-head")
    torch.manual_seed(1)
    DraftModel(DraftModel.from_pretrained(head_dir).config).save_pretrained(other)
    put_in_cache(cache, HEAD, other, ref="v2")
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<the cache> for this process (huggingface_hub reads them at import)."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_the_cache_is_in_huggingface_hubs_own_layout(hub_cache):
    info = huggingface_hub.scan_cache_dir(hub_cache)
    assert not info.warnings
    assert {r.repo_id for r in info.repos} == {TARGET, HEAD, STUDENT, OFFICIAL_GRIFFIN, OFFICIAL_EAGLE}
    refs = {ref for r in info.repos if r.repo_id == HEAD for rev in r.revisions for ref in rev.refs}
    assert refs == {"main", "v2"}


def test_hub_ids_and_local_spellings():
    assert hub_id("org/name") == ("org/name", None)
    assert hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for local in ["smollm2-135m-instruct", "checkpoints/a/b", "/abs/head", "./head", "~/head", "org/name@", "a/b@c@d",
                  "org/na--me"]:
        assert hub_id(local) is None, local


def test_target_and_head_by_id_offline_generate_exactly_like_generate(offline, tiny_target_dir):
    gen = SpecGenerator.from_pretrained(TARGET, draft=HEAD, total_tokens=8, depth=3, top_k=4, dtype="fp32",
                                        device="cpu")
    assert gen.draft_path == offline / f"models--{HEAD.replace('/', '--')}" / "snapshots" / commit_of(f"{HEAD}@main")
    assert gen.target.config._name_or_path == TARGET
    reference, _ = load_target(tiny_target_dir, dtype="fp32", device="cpu")
    for prompt in ["What is the capital of France?", "Write a haiku about autumn."]:
        ids = gen.encode([{"role": "user", "content": prompt}])
        ours = gen.generate(ids, max_new_tokens=24)
        ref = reference.generate(ids[None], max_new_tokens=24, do_sample=False)
        assert torch.equal(ours.sequences, ref), prompt


def test_a_target_loaded_by_id_finds_its_tokenizer_in_the_cache(offline):
    model, tokenizer = load_target(TARGET, dtype="fp32", device="cpu")
    gen = SpecGenerator.from_pretrained(model, draft=HEAD, total_tokens=4)
    assert gen.tokenizer.get_vocab() == tokenizer.get_vocab()


def test_draft_lm_by_id_offline_generates_exactly_like_generate(offline, tiny_target_dir):
    gen = SpecGenerator.from_pretrained(TARGET, draft_model=STUDENT, gamma=3, dtype="fp32", device="cpu")
    model, tokenizer, vocab = load_draft_lm(STUDENT)
    assert vocab is None and model.config.num_hidden_layers == 1 and tokenizer.get_vocab() == gen.tokenizer.get_vocab()
    reference, _ = load_target(tiny_target_dir, dtype="fp32", device="cpu")
    ids = gen.encode([{"role": "user", "content": "List three prime numbers."}])
    ref = reference.generate(ids[None], max_new_tokens=24, do_sample=False)
    assert torch.equal(gen.generate(ids, max_new_tokens=24).sequences, ref)


def test_a_loaded_draft_lm_named_by_its_hub_id_finds_its_tokenizer_in_the_cache(offline):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(resolve(STUDENT, kind="draft LM"))
    lm.config._name_or_path = STUDENT  # as from_pretrained(STUDENT) records it
    gen = SpecGenerator.from_pretrained(TARGET, draft_model=lm, gamma=2, dtype="fp32", device="cpu")
    assert gen.draft.model is lm


def test_official_heads_by_id_load_as_from_their_folders(offline):
    for repo, folder in [(OFFICIAL_GRIFFIN, "official-griffin"), (OFFICIAL_EAGLE, "official-eagle")]:
        by_id, by_folder = DraftModel.from_pretrained(repo), DraftModel.from_pretrained(FIXTURES / folder)
        assert by_id.config.arch == by_folder.config.arch
        theirs = by_folder.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in by_id.state_dict().items()) and by_id.state_dict().keys() \
            == theirs.keys()


def test_revisions_by_argument_or_spelling(offline, head_dir):
    main, v2 = DraftModel.from_pretrained(HEAD), DraftModel.from_pretrained(HEAD, revision="v2")
    weight = "fusion.fc.weight"
    assert torch.equal(main.state_dict()[weight], DraftModel.from_pretrained(head_dir).state_dict()[weight])
    assert not torch.equal(main.state_dict()[weight], v2.state_dict()[weight])
    assert torch.equal(DraftModel.from_pretrained(f"{HEAD}@v2").state_dict()[weight], v2.state_dict()[weight])
    commit = commit_of(f"{HEAD}@v2")
    assert resolve(f"{HEAD}@{commit}", kind="draft head").name == commit
    with pytest.raises(ValueError, match="names revision 'v2' but revision='main'"):
        resolve(f"{HEAD}@v2", kind="draft head", revision="main")
    with pytest.raises(FileNotFoundError, match=f"{HEAD} at revision 'v3' is not in the local Hub cache"):
        DraftModel.from_pretrained(HEAD, revision="v3")


def test_a_local_folder_of_the_same_spelling_wins(offline, tmp_path, monkeypatch, head_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(head_dir, tmp_path / OFFICIAL_GRIFFIN)  # a local folder spelled like a cached official head
    assert resolve(OFFICIAL_GRIFFIN, kind="draft head") == Path(OFFICIAL_GRIFFIN)
    assert DraftModel.from_pretrained(OFFICIAL_GRIFFIN).config.arch == "griffin"
    assert DraftModel.from_pretrained(OFFICIAL_GRIFFIN).config.hidden_size == 32  # the tiny head, not the fixture's 64
    with pytest.raises(FileNotFoundError, match="not a draft head folder"):  # no Hub id: the loader's own error
        DraftModel.from_pretrained("heads/griffin/stage-1")


def test_the_target_head_and_config_by_id(offline, tiny_target_dir):
    head = load_target_head(TARGET)
    reference, _ = load_target(tiny_target_dir, dtype="fp32", device="cpu")
    assert torch.equal(head.get_output_embeddings().weight, reference.get_output_embeddings().weight)
    assert head.config._name_or_path == TARGET


@pytest.mark.parametrize("load", [
    lambda name: load_target(name), lambda name: DraftModel.from_pretrained(name), lambda name: load_draft_lm(name),
    lambda name: SpecGenerator.from_pretrained(name)])
def test_an_uncached_id_offline_is_one_line_naming_it_and_the_fix_at_once(offline, load):
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as err:
        load(MISSING)
    seconds = time.perf_counter() - start
    text = str(err.value)
    assert "\n" not in text and seconds < 1.0, (text, seconds)
    for part in [MISSING, "is not in the local Hub cache", str(offline), f"`hf download {MISSING}`",
                 "unset HF_HUB_OFFLINE"]:
        assert part in text, (part, text)


def test_a_cached_model_loads_and_an_uncached_one_fails_when_the_hub_is_unreachable(hub_cache, monkeypatch):
    """Not offline, but the Hub does not answer (a closed local port): the cache serves what it holds."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.perf_counter()
    assert DraftModel.from_pretrained(HEAD).config.arch == "griffin"
    assert (resolve(TARGET, kind="target") / "model.safetensors").is_file()
    assert time.perf_counter() - start < 10  # huggingface_hub retries a file listing for 23 s: none is asked for
    with pytest.raises(FileNotFoundError, match="while the Hugging Face Hub cannot be reached: fetch it where the "
                                                f"Hub is reachable with `hf download {MISSING} --revision v1`"):
        DraftModel.from_pretrained(f"{MISSING}@v1")


COMMANDS = [("inference.demo", ["--target", MISSING]), ("inference.demo", ["--draft", MISSING]),
            ("inference.speed", ["--target", MISSING]), ("inference.tau", ["--heads", MISSING]),
            ("training.build_features", ["--target", MISSING, "--out", "{tmp}/features"]),
            ("training.distill", ["--target", MISSING, "--out", "{tmp}/distill"]),
            ("training.export", [MISSING, "{tmp}/export"]),
            ("training.evaluate", [MISSING, "--features", "{tmp}/features"])]


@pytest.mark.parametrize("module,args", COMMANDS)
def test_commands_name_an_uncached_id_in_one_line(offline, tmp_path, module, args):
    code, err = run_main(module, *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"`hf download {MISSING}`" in err and "Traceback" not in err


@pytest.mark.parametrize("module,args", [("inference.demo", ["--target", MISSING]),
                                         ("training.export", [f"{MISSING}@v1", "{tmp}/export"])])
def test_commands_refuse_an_uncached_id_offline_before_loading_torch(hub_cache, tmp_path, module, args):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    run = run_module(module, *[a.format(tmp=tmp_path) for a in args], env=env,
                     launcher=[sys.executable, "-X", "importtime", "-m"])
    lines = run.stderr.splitlines()
    said = [line for line in lines if not line.startswith("import time:")]
    assert run.returncode == 2 and len(said) == 1 and said[0].startswith("error: ") and MISSING in said[0], said
    assert "torch" not in {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}


def test_a_cached_language_model_named_as_a_head_is_a_usage_error(offline):
    code, err = run_main("inference.demo", "--draft", TARGET)
    assert code == 2 and f"argument --draft: the Hub model {TARGET} has 2 layers" in err, err


def test_train_init_from_and_reference_take_hub_ids(offline):
    from argparse import Namespace

    from training.train import build_head, load_reference

    target_head = load_target_head(TARGET)
    draft = build_head(Namespace(init_from=f"{HEAD}@v2", arch="griffin", draft_vocab=None, no_tgf=False,
                                 no_dual_heads=False, intermediate_size=None), None, target_head)
    v2 = DraftModel.from_pretrained(HEAD, revision="v2")
    assert torch.equal(draft.fusion.fc.weight, v2.fusion.fc.weight)
    assert torch.equal(load_reference(HEAD, draft, target_head).fusion.fc.weight,
                       DraftModel.from_pretrained(HEAD).fusion.fc.weight)


def test_demo_command_with_hub_ids_offline(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    run = run_module("inference.demo", "--target", TARGET, "--draft", f"{HEAD}@v2", "--prompt", "Hi there",
                     "--max-new-tokens", "12", "--total-tokens", "6", "--device", "cpu", env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "output identical to transformers' generate" in run.stdout, run.stdout


class LocalHub:
    """A Hub server over local folders: ``repos`` {id: folder} at revision ``main`` (commit: sha1 of the id);
    ``gated`` ids answer 403 GatedRepo, unknown ids 401 RepoNotFound, unknown revisions 404 RevisionNotFound."""

    ROUTE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/?]+)|"
                       r"/(?P<frepo>[^/]+/[^/]+)/resolve/(?P<frev>[^/]+)/(?P<file>[^?]+)")

    def __init__(self, repos: dict[str, Path], gated: frozenset[str] = frozenset()):
        self.repos, self.gated, self.fetched = repos, gated, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.send(*hub.answer(self.path, self.command == "GET"), body=False)

            def do_GET(self):
                self.send(*hub.answer(self.path, self.command == "GET"))

            def send(self, code: int, data: bytes, headers: dict, body: bool = True):
                self.send_response(code)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, get: bool) -> tuple[int, bytes, dict]:
        match = self.ROUTE.match(path)
        if not match:
            return 404, b"", {}
        repo, rev = match["repo"] or match["frepo"], match["rev"] or match["frev"]
        commit = hashlib.sha1(repo.encode()).hexdigest()
        if repo not in self.repos:
            return 401, b"", {"X-Error-Code": "RepoNotFound"}
        if repo in self.gated:
            return 403, b"", {"X-Error-Code": "GatedRepo"}
        if rev not in ("main", commit):
            return 404, b"", {"X-Error-Code": "RevisionNotFound"}
        folder = self.repos[repo]
        if match["kind"] == "revision":
            return 200, json.dumps({"id": repo, "sha": commit}).encode(), {"Content-Type": "application/json"}
        if match["kind"] == "tree":
            files = [{"type": "file", "path": p.relative_to(folder).as_posix(), "size": p.stat().st_size,
                      "oid": hashlib.sha1(p.read_bytes()).hexdigest()}
                     for p in sorted(folder.rglob("*")) if p.is_file()]
            return 200, json.dumps(files).encode(), {"Content-Type": "application/json"}
        file = folder / match["file"]
        if not file.is_file():
            return 404, b"", {"X-Error-Code": "EntryNotFound"}
        if get:
            self.fetched.append(f"{repo}/{match['file']}")
        data = file.read_bytes()
        return 200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}


@pytest.fixture
def local_hub(monkeypatch, tmp_path, tiny_target_dir, head_dir):
    """The tiny target, its head, a sharded target (and copies of its weights the loaders do not read) and a gated
    model on a local Hub server, with an empty cache: the Hub's default endpoint points there."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    for key, shard in shards.items():
        save_file({key: torch.zeros(2)}, str(sharded / shard))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    save_file({"a": torch.zeros(2), "b": torch.zeros(2)}, str(sharded / "consolidated.safetensors"))
    torch.save({"a": torch.zeros(2)}, sharded / "pytorch_model.bin")
    hub = LocalHub({TARGET: tiny_target_dir, HEAD: head_dir, "org/sharded": sharded, "org/gated": head_dir},
                   gated=frozenset({"org/gated"}))
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield hub
    hub.server.shutdown()


def test_first_use_fetches_what_the_loaders_read_then_the_cache_serves_offline(local_hub, tiny_target_dir,
                                                                              monkeypatch):
    gen = SpecGenerator.from_pretrained(TARGET, draft=HEAD, total_tokens=6, dtype="fp32", device="cpu")
    assert "tiny-org/tiny-llama/model.safetensors" in local_hub.fetched
    reference, _ = load_target(tiny_target_dir, dtype="fp32", device="cpu")
    ids = gen.encode([{"role": "user", "content": "Tell me a fun fact about owls."}])
    assert torch.equal(gen.generate(ids, max_new_tokens=16).sequences,
                       reference.generate(ids[None], max_new_tokens=16, do_sample=False))
    folder = resolve("org/sharded", kind="target")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors",
                                                          "model.safetensors.index.json"]  # no .bin, no consolidated
    local_hub.server.shutdown()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert resolve("org/sharded", kind="target") == folder
    assert DraftModel.from_pretrained(HEAD).config.arch == "griffin"


def test_a_language_model_named_as_a_head_is_refused_before_its_weights_download(local_hub):
    with pytest.raises(ValueError, match=f"^the Hub model {TARGET} has 2 layers: it is a language model, not a draft "
                                         "head"):
        SpecGenerator.from_pretrained(TARGET, draft=TARGET)
    assert local_hub.fetched == [f"{TARGET}/config.json"]


def test_the_hubs_refusals_are_one_line_naming_the_fix(local_hub):
    with pytest.raises(FileNotFoundError, match=r"^nobody/absent is neither a local folder nor a draft head on the "
                                                r"Hugging Face Hub \(a private model needs a login: log in with"):
        DraftModel.from_pretrained("nobody/absent")
    with pytest.raises(PermissionError, match=f"^the Hub model org/gated is gated: accept its terms on "
                                              f"{local_hub.url}/org/gated, then log in with `hf auth login`"):
        load_target("org/gated")
    with pytest.raises(FileNotFoundError, match="^the Hub model tiny-org/tiny-llama has no revision 'v9'$"):
        load_target(f"{TARGET}@v9")
