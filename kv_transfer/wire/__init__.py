"""What every K/V transport and both connector sides share: ``config`` (endpoint settings), ``header`` (the part's
wire header and its checks; torch-free), ``payload_mac`` (the payload's keyed tag, on its device), ``result_message``
(a ``PrefillResult`` behind the last part), ``layer_parts`` (pack / verify+install one layer's part), ``base`` (the
backend interface, transfer handles, receive buffers), ``streams`` (the stream seam every handoff follows),
``store_auth`` (the authenticated rendezvous store) and ``head_routes`` (which rank sends which KV heads where).
The floor of kv_transfer/: it imports neither the backends nor the connector."""
