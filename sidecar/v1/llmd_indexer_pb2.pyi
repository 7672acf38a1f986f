from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetPodScoresRequest(_message.Message):
    __slots__ = ("prompt", "model_name", "pod_identifiers")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    POD_IDENTIFIERS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    model_name: str
    pod_identifiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, prompt: _Optional[str] = ..., model_name: _Optional[str] = ..., pod_identifiers: _Optional[_Iterable[str]] = ...) -> None: ...

class GetPodScoresResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[PodScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[PodScore, _Mapping]]] = ...) -> None: ...

class PodScore(_message.Message):
    __slots__ = ("pod", "score")
    POD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    pod: str
    score: float
    def __init__(self, pod: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...
