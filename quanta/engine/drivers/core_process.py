"""The engine process: one EngineCore stepping in a process of its own, driven over a pipe by ProcessEngine
(process_engine.py) in the server's process, and the messages between them (run says the wire).

The server's event loop does HTTP, JSON and SSE for every request; the core's step is Python too
(scheduling, folding tokens, stop rules, detokenizing). Under one GIL the two would take turns; here they
overlap: this process only steps and tells, the other only serves.
"""
from __future__ import annotations

import logging
import pickle
import queue
import threading

log = logging.getLogger(__name__)


def gauges(core) -> dict[str, int]:
    """A core's scheduler and pool figures, as /metrics shows them."""
    s, pool = core.scheduler, core.pool
    return {"running": len(s.running), "waiting": len(s.waiting), "free_blocks": pool.num_free,
            "total_blocks": pool.num_blocks, "preemptions": s.num_preemptions}


def delta_of(out, sent: dict[str, list]) -> tuple:
    """The update for one RequestOutput: (request_id, finished, error, samples), each sample
    (index, new token ids, kept text length, new text tail, new logprobs or None, cumulative logprob,
    finish_reason, stop_reason). `sent` holds per request and sample what was sent before
    ([tokens, text, logprobs]) and is updated; a finished request is dropped from it."""
    marks = sent.setdefault(out.request_id, {})
    samples = []
    for s in out.outputs:
        tokens, text, lps = marks.get(s.index) or (0, "", 0)
        keep = len(text) if s.text.startswith(text) else 0
        new_lps = None if s.logprobs is None else s.logprobs[lps:]
        samples.append((s.index, s.token_ids[tokens:], keep, s.text[keep:], new_lps, s.cumulative_logprob,
                        s.finish_reason, s.stop_reason))
        marks[s.index] = (len(s.token_ids), s.text, 0 if s.logprobs is None else len(s.logprobs))
    if out.finished:
        sent.pop(out.request_id, None)
    return out.request_id, out.finished, getattr(out, "error", None), samples


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _read(conn, inbox: queue.SimpleQueue) -> None:
    """Move the parent's messages into `inbox` as they come, so the parent never waits on a step."""
    try:
        while True:
            msg = conn.recv()
            inbox.put(msg)
            if msg is None:
                return
    except (EOFError, OSError):                     # the parent is gone: end the loop
        inbox.put(None)


def run(config, conn, parent_end=None) -> None:
    """The engine process' body: build the core, answer ready (or failed), then loop until told to stop
    or the parent goes away. `parent_end`: the parent's end of the pipe, which a forked child closes
    so that the parent's exit reaches it as the end of the pipe.

    The wire, pickled over a multiprocessing Connection:
      parent -> child: a list of commands per message, ("add", request_id, prompt_ids, params, prompt, lora_request) or
                       ("abort", request_id), applied in order between steps; None asks the loop to end.
      child -> parent: ("ready", info) once the core is built, or ("failed", exception);
                       ("step", updates, rejects, added, gauges) after every pass of the loop, one message
                       for all the requests that advanced (updates: delta_of); rejects: (request_id,
                       exception) for adds the core refused; added: the request ids taken in this pass;
                       gauges: scheduler and pool figures for /metrics;
                       ("dead", message) when the core failed (the process then ends).
    A request's updates carry only what is new since the last one (tokens, text, logprobs), so a step's
    message stays small whatever the output lengths. A writer thread sends them, so a parent that reads
    slowly never stalls the loop; passes that queue up meanwhile go as one step message (merge_steps)."""
    if parent_end is not None:
        parent_end.close()
    from quanta.engine.core import EngineCore
    try:
        core = EngineCore(config)
    except BaseException as e:
        try:
            conn.send(("failed", _picklable(e)))
        except OSError:                             # the parent has gone already (it failed first): its
            pass                                    # error line is the one the user sees
        return
    conn.send(("ready", {"max_model_len": core.max_model_len, "num_kv_blocks": core.num_kv_blocks}))
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read, args=(conn, inbox), name="quanta-engine-inbox", daemon=True).start()
    writer = threading.Thread(target=_write, args=(conn, outbox), name="quanta-engine-outbox", daemon=True)
    writer.start()
    try:
        _loop(core, outbox, inbox)
    except BaseException as e:
        log.exception("engine loop failed")
        outbox.put(("dead", f"{e!r}"))
    finally:
        outbox.put(None)
        writer.join(10)
        core.close()


def _write(conn, outbox: queue.SimpleQueue) -> None:
    """Send the loop's messages to the parent, so that the loop never waits on a parent busy serving (a
    full pipe would block its send). Step messages that queued up while a send waited go as one."""
    try:
        while (msg := outbox.get()) is not None:
            while msg[0] == "step" and not outbox.empty():
                nxt = outbox.get_nowait()
                if nxt is None or nxt[0] != "step":
                    conn.send(msg)
                    msg = nxt
                    break
                msg = merge_steps(msg, nxt)
            if msg is None:
                return
            conn.send(msg)
    except OSError:                                 # the parent is gone: the reader ends the loop
        return
    except Exception as e:                          # a message that cannot be sent: the engine is done for
        log.exception("engine message not sent")
        try:
            conn.send(("dead", f"{e!r}"))
        except Exception:                           # noqa: BLE001 -- nothing more can reach the parent
            pass


def merge_steps(a: tuple, b: tuple) -> tuple:
    """Two consecutive step messages as one: updates, rejects and added in order, b's gauges."""
    return ("step", a[1] + b[1], a[2] + b[2], a[3] + b[3], b[4])


def _loop(core, outbox: queue.SimpleQueue, inbox: queue.SimpleQueue) -> None:
    sent: dict[str, dict] = {}
    while True:
        batches = [] if core.has_unfinished() else [inbox.get()]       # idle: sleep until told something
        while not inbox.empty():
            batches.append(inbox.get_nowait())
        if any(b is None for b in batches):
            return
        updates, rejects, added = [], [], []
        for cmd in (c for b in batches for c in b):
            if cmd[0] == "add":
                _, rid, ids, params, prompt, lora_request = cmd
                added.append(rid)
                try:
                    core.add_request(ids, params, rid, prompt=prompt, lora_request=lora_request)
                except Exception as e:                 # that request's fault only: the loop goes on
                    rejects.append((rid, _picklable(e)))
            else:
                out = core.abort(cmd[1])
                if out is not None:
                    updates.append(delta_of(out, sent))
        if core.has_unfinished():
            updates += [delta_of(out, sent) for out in core.step(True)]
        outbox.put(("step", updates, rejects, added, gauges(core)))
