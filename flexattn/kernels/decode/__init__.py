"""Split-KV decoding: ``sm90`` (GQA-packed rows, paged KV read in place) and ``combine``
(the merge of split partials by their LSEs)."""
