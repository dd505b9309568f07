"""Stage 3 per layer: the layer stacks named by ``layers=`` (:mod:`.plan`: the loss hook,
:func:`gather_layer`, which stages reduce in the backward), :func:`scan_layers` with the next
layer prefetched (:mod:`.scan`), and the vocabulary-parallel table (:mod:`.vocab`)."""

from jaxzero.zero.layers.plan import LayerPlan as LayerPlan
from jaxzero.zero.layers.plan import gather_layer as gather_layer
from jaxzero.zero.layers.scan import scan_layers as scan_layers
from jaxzero.zero.layers.scan import stacked_init as stacked_init
from jaxzero.zero.layers.scan import stacked_params as stacked_params
from jaxzero.zero.layers.vocab import VocabParallelEmbed as VocabParallelEmbed
from jaxzero.zero.layers.vocab import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from jaxzero.zero.layers.vocab import vocab_parallel_embed as vocab_parallel_embed
from jaxzero.zero.layers.vocab import vocab_table as vocab_table
