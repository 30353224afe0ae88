"""Dense -> MoE conversion of the pretrained MiniLM-L6 (MoEfication-style).

Public API:
    BertMoEModel, BertMoEConfig, BertExpert   the converted model (model.py)
    BertMoEAdapter, load_bert_moe             its MoEModelAdapter (adapter.py)
    ConvertOptions                            every knob of a conversion (options.py)
    convert_bert                              the conversion (convert.py, finetune.py)
    fidelity, sentence_embeddings             its quality measure (evaluate.py)
    minilm_dir, load_dense, wikitext2_lines   its inputs (source.py)
    balanced_kmeans                           equal-size neuron clustering (cluster.py)

Importing this package registers the ``MoefleetBertMoE`` architecture with
:func:`moefleet.models.register_architecture`, so ``load_adapter(dir)`` opens saved
conversions. The zoo entries live in :mod:`moefleet.models.moefy.entries`.
"""

from __future__ import annotations

from moefleet.models.base import MoEModelAdapter
from moefleet.models.moefy.adapter import BertMoEAdapter, load_bert_moe
from moefleet.models.moefy.cluster import balanced_kmeans
from moefleet.models.moefy.convert import convert_bert
from moefleet.models.moefy.evaluate import fidelity, sentence_embeddings
from moefleet.models.moefy.model import ARCHITECTURE, BertExpert, BertMoEConfig, BertMoEModel
from moefleet.models.moefy.options import ConvertOptions
from moefleet.models.moefy.source import load_dense, minilm_dir, wikitext2_lines
from moefleet.models.registry import register_architecture


def _load(ref: str, name: str) -> MoEModelAdapter:
    return load_bert_moe(ref, name=name)


register_architecture(ARCHITECTURE, _load)

__all__ = [
    "ARCHITECTURE",
    "BertExpert",
    "BertMoEAdapter",
    "BertMoEConfig",
    "BertMoEModel",
    "ConvertOptions",
    "balanced_kmeans",
    "convert_bert",
    "fidelity",
    "load_bert_moe",
    "load_dense",
    "minilm_dir",
    "sentence_embeddings",
    "wikitext2_lines",
]
