"""The background save's thread: it works on the GPU of the thread that asked for the
save (checked on CPU with torch.cuda's answers stood in; the CUDA lane runs it on a GPU)."""

import threading

import torch

from fullshard.checkpoint import background


def test_the_background_save_thread_works_on_the_callers_gpu(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: seen.append(("set_device", device,
                                                    threading.current_thread().name)))

    def job():
        seen.append(("job", threading.current_thread().name))
        return "done"
    assert background.submit(job).result() == "done"
    background.wait_for_pending_save()
    (what, device, thread), (then, job_thread) = seen
    assert (what, device, then) == ("set_device", 3, "job")
    assert thread == job_thread != threading.current_thread().name
