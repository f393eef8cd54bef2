"""The served base models' tokenizers, answered as the Hugging Face Hub answers them, at /hf.

The tinker SDK's `get_tokenizer()` runs `AutoTokenizer.from_pretrained(<base model name>)` on the client, which asks
the Hub; a client machine without it waits ~45 s in huggingface_hub's retries. With `HF_ENDPOINT=<server>/hf` in the
client's environment (docs/tinker-surface.md; the workbench's connect() points its own loads here, see
workbench/client/tokenizers.py) huggingface_hub asks this server instead and gets the very files the server's model
folder holds, so the tokens a client makes are the tokens the server trains on.

Only what tokenizer loading asks for, for the models this server serves (base_models.resolve): a file's metadata
and bytes (`HEAD`/`GET /hf/{repo}/resolve/{revision}/{file}`), and the repo's info and file list. Anything else is
the Hub's own 404 (X-Error-Code EntryNotFound / RepoNotFound / RevisionNotFound), which huggingface_hub and
transformers take as "no such file" and move on. The revision is a digest of the files, so a client's cache follows
an operator's change of the folder.

No API key: huggingface_hub sends none of ours (HF_TOKEN is the Hub's), and a served model's tokenizer files are
public for the registry models and no secret for a registered one (docs/security.md says so). Nothing here loads a
model or converts one a request names: an unknown name is a 404 before any work.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import FileResponse, JSONResponse

from kernel_backend.api.tinker import service
from kernel_backend.engine import base_models
from kernel_backend.errors import UserError
from kernel_backend.service import Service

router = APIRouter(prefix="/hf", include_in_schema=False)


def _not_found(code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=404, headers={"X-Error-Code": code, "X-Error-Message": message})


def _tokenizer_files(svc: Service, repo: str) -> dict[str, Path] | None:
    """{file name: path} of the tokenizer files a served model's folder holds; None for a name this server does not
    serve. A registry model not converted yet is not served here (converting is model work a key pays for)."""
    name = base_models.ALIASES.get(repo, repo)
    registered = base_models.registered_models(list(svc.settings.base_models))
    if name not in registered and not (name in base_models.GGUF_MODELS
                                       and base_models.converted(name, svc.settings.models_dir)):
        return None
    try:
        folder = base_models.resolve(name, svc.settings.models_dir, svc.settings.base_models)[1]
    except UserError:
        return None
    return {file: folder / file for file in base_models.HUB_CACHE_FILES if (folder / file).is_file()}


def _commit(digests: dict[str, str]) -> str:
    """A 40-hex revision id from the files' names and SHA-256s: the same files, the same id."""
    digest = hashlib.sha1()
    for name, sha256 in sorted(digests.items()):
        digest.update(name.encode() + b"\0" + bytes.fromhex(sha256))
    return digest.hexdigest()


def _repo(svc: Service, repo: str, revision: str) -> tuple[dict[str, Path], dict[str, str], str] | JSONResponse:
    """The served repo's files, their SHA-256s (each file read once a request) and its revision; or the Hub's 404."""
    files = _tokenizer_files(svc, repo)
    if files is None:
        return _not_found("RepoNotFound", f"{repo!r} is not a base model this Stepwise server serves")
    digests = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()}
    commit = _commit(digests)
    if revision not in ("main", commit):
        return _not_found("RevisionNotFound", f"{repo!r} has only the revision 'main' ({commit}) here")
    return files, digests, commit


@router.api_route("/{repo:path}/resolve/{revision}/{filename:path}", methods=["GET", "HEAD"])
def resolve_file(repo: str, revision: str, filename: str, request: Request, svc: Service = Depends(service)):
    found = _repo(svc, repo, revision)
    if isinstance(found, JSONResponse):
        return found
    files, digests, commit = found
    if filename not in files:
        return _not_found("EntryNotFound", f"{filename!r} is not among {repo!r}'s tokenizer files here")
    path = files[filename]
    headers = {"X-Repo-Commit": commit, "ETag": f'"{digests[filename]}"'}
    if request.method == "HEAD":
        return Response(headers={**headers, "Content-Length": str(path.stat().st_size)})
    return FileResponse(path, headers=headers)


def _info(repo: str, found: tuple[dict[str, Path], dict[str, str], str]) -> dict:
    files, _, commit = found
    return {"id": repo, "modelId": repo, "sha": commit, "private": False, "disabled": False, "gated": False,
            "siblings": [{"rfilename": name} for name in sorted(files)], "tags": [], "library_name": "transformers"}


@router.get("/api/models/{repo:path}/revision/{revision}")
def model_info_at(repo: str, revision: str, svc: Service = Depends(service)):
    found = _repo(svc, repo, revision)
    return found if isinstance(found, JSONResponse) else _info(repo, found)


@router.get("/api/models/{repo:path}/tree/{revision}")
@router.get("/api/models/{repo:path}/tree/{revision}/{folder:path}")
def list_files(repo: str, revision: str, folder: str = "", svc: Service = Depends(service)):
    found = _repo(svc, repo, revision)
    if isinstance(found, JSONResponse):
        return found
    files, _, _ = found
    if folder.strip("/"):  # the tokenizer files lie at the top; no folder of them exists (e.g. additional_chat_templates)
        return _not_found("EntryNotFound", f"{repo!r} has no folder {folder!r} here")
    return [{"type": "file", "path": name, "size": path.stat().st_size, "oid": hashlib.sha1(path.read_bytes()).hexdigest()}
            for name, path in sorted(files.items())]


@router.get("/api/models/{repo:path}")
def model_info(repo: str, svc: Service = Depends(service)):
    found = _repo(svc, repo, "main")
    return found if isinstance(found, JSONResponse) else _info(repo, found)
