"""The HTTP-cost bench's client side: the request it sends (ids as the prompt, greedy, usage in
the stream, speculation as asked) and the tokens it counts (the usage chunk's, not the chunks)."""

from types import SimpleNamespace

from loadtest.bench.http_cost import over_http


class FakeCompletions:
    def __init__(self):
        self.sent: dict = {}

    def create(self, **kw):
        self.sent = kw
        text = [SimpleNamespace(usage=None, choices=[SimpleNamespace(text="ab")])] * 3
        return iter(text + [SimpleNamespace(usage=SimpleNamespace(completion_tokens=7))])


def test_sends_the_ids_greedy_and_counts_the_usage_tokens():
    client = SimpleNamespace(completions=FakeCompletions())
    tokens, secs = over_http(client, "m", [1, 2, 3], 16, k=0)
    sent = client.completions.sent
    assert tokens == 7 and secs >= 0
    assert sent["prompt"] == [1, 2, 3] and sent["temperature"] == 0 and sent["stream"]
    assert sent["max_tokens"] == 16 and sent["stream_options"] == {"include_usage": True}
    assert sent["extra_body"] == {"speculation": {"enabled": False}}
    over_http(client, "m", [1], 4, k=2)
    assert client.completions.sent["extra_body"] == {"speculation": {"k": 2}}
