"""The rerank request body as Cohere (v1/v2), Jina and vLLM take it, and as Open WebUI's
external reranker sends it. Unknown fields are ignored, like the other OpenAI-style bodies."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    # Jina's and vLLM's default; Cohere v1's was false (its v2 dropped the field).
    return_documents: bool = True

    @field_validator("documents")
    @classmethod
    def _no_empty_document(cls, value: list[str | RerankDocument]) -> list[str | RerankDocument]:
        empty = next((i for i, doc in enumerate(value) if not _text(doc)), None)
        if empty is not None:
            raise ValueError(f"documents[{empty}] is empty")
        return value

    def texts(self) -> list[str]:
        return [_text(doc) for doc in self.documents]


def _text(document: str | RerankDocument) -> str:
    return document if isinstance(document, str) else document.text
