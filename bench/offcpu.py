#!/usr/bin/env python3
"""Where the ranks wait: off-CPU time per call chain, from a perf sched_switch recording.

    perf record -e sched:sched_switch --call-graph dwarf,16384 -o sw.data \
        build/lockstep train --nproc 2 ... train.threads=1
    perf script -i sw.data -F tid,time,event,trace,ip,sym | bench/offcpu.py [N]

(perf is Debian's linux-perf package; the sched tracepoint needs root or perf_event_paranoid <= 1.)

Each time a thread leaves the CPU sleeping (state S or D) the interval until it next runs is
charged to its first three lockstep frames (the transport's and the thread pool's own frames
skipped), so a rank waiting for its peer at a collective shows as `Work::wait < <the caller>`,
or, for a blocking one it runs itself (ProgressThread::run_here), as the collective's step (e.g.
`all_gather_step < Work::wait < <the caller>`).
Prints the N (default 25) largest totals over all threads, in milliseconds. Under the thread
backend the per-rank progress threads' idle time shows as `ProgressThread::loop`, and start-up
allocations as the constructors'; compare two binaries or two modes on the same command.
"""
import collections
import re
import sys

SWITCH = re.compile(r"\s*(\d+)\s+([\d.]+): sched:sched_switch: prev_comm=\S+ prev_pid=(\d+) prev_prio=\d+ "
                    r"prev_state=(\S+) ==> next_comm=\S+ next_pid=(\d+)")
SKIP = ("ThreadTransport", "parallel_for", "_M_invoke", "ProgressThread::execute", "ProgressThread::run_here")


def main():
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 25
    total = collections.Counter()
    asleep = {}  # tid -> (time it left, charged key)
    event = None

    def close(ev):
        if ev is None:
            return
        t, prev, state, nxt, frames = ev
        if nxt in asleep:
            t0, key = asleep.pop(nxt)
            total[key] += t - t0
        if state[0] in "SD":
            own = [f for f in frames if "lockstep::" in f and not any(s in f for s in SKIP)]
            asleep[prev] = (t, " < ".join(f[:70] for f in own[:3]) or "(outside lockstep)")

    for line in sys.stdin:
        m = SWITCH.match(line)
        if m:
            close(event)
            event = (float(m.group(2)), m.group(3), m.group(4), m.group(5), [])
        elif event is not None and line.strip():
            parts = line.strip().split(None, 1)
            if len(parts) == 2:
                event[4].append(parts[1])
    close(event)
    for key, seconds in total.most_common(top):
        print(f"{seconds * 1000:9.1f} ms  {key}")


if __name__ == "__main__":
    main()
