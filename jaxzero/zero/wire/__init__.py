"""How the collectives encode what they move: :class:`Wire` and its codecs, exact or ZeRO++'s
blockwise int8/int4 (:mod:`.encodings`), over the quantizer itself (:mod:`.quantize`)."""

from jaxzero.zero.wire.encodings import Blockwise as Blockwise
from jaxzero.zero.wire.encodings import Exact as Exact
from jaxzero.zero.wire.encodings import Wire as Wire
from jaxzero.zero.wire.encodings import WireReport as WireReport
from jaxzero.zero.wire.encodings import wire as wire
