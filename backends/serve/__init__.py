"""`runner serve`: the local backend behind the Tinker service's HTTP API, so Tinker programs (the tinker SDK,
tinker-cookbook) run offline. service.py is the API, http.py the server, store.py what is kept on disk,
wire.py the protobuf codecs, losses.py gspo and stable_reinforce, topk.py top-k logprobs."""
