"""Stage 3 per module (``units=``, FSDP2's ``fully_shard``): the patterns and their checks
(:mod:`.patterns`), the loss hook that cuts the loss's jaxpr into unit segments (:mod:`.plan`,
evaluated by :mod:`.evaluator`), and the prefetched chain of segments (:mod:`.chain`)."""
