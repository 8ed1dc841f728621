"""A stand-in for ``torch.cuda``'s streams and events that records what is asked of it:
the CUDA stream rules (Note [streams and events]) checked on CPU."""

import contextlib


class RecordedEvent:
    def __init__(self, log, stream):
        self.stream = stream
        log.append(("record", stream.name, self))

    def query(self):
        return True

    def synchronize(self):
        pass


class RecordedStream:
    def __init__(self, streams, name):
        self.streams, self.name = streams, name

    def wait_stream(self, other):
        self.streams.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.streams.log.append(("wait_event", self.name, event))

    def record_event(self):
        return RecordedEvent(self.streams.log, self)


class RecordingStreams:
    """What HostCopies uses of ``torch.cuda``: streams, events, the current stream."""

    def __init__(self):
        self.log = []
        self.made = 0
        self.current = RecordedStream(self, "compute")

    def Stream(self, device):  # noqa: N802 - torch.cuda's name
        self.made += 1
        return RecordedStream(self, ("to_host", "to_device")[self.made - 1] if self.made <= 2
                       else f"stream{self.made}")

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("leave", stream.name))
