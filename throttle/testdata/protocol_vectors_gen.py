# Writes protocol_vectors.json (python3 protocol_vectors_gen.py >
# protocol_vectors.json). Every expected value below is an offset from N
# worked out by hand from the GCRA definition (docs/PROTOCOL.md), each
# vector's note says how; this file only adds N and lays the JSON out.
# Nothing here comes from running the scripts: TestProtocolVectors checks
# the scripts against the result.
import json
N = 1767225600000000          # 2026-01-01T00:00:00Z in microseconds
H = 31622400000000            # the horizon, 366 days in microseconds
def T(x): return N + x
P = "slotbook:"
K1 = P + "api:{s}"
K2 = P + "api:{s}:60000ms"    # the 20/min limit's key (period 60000 ms)
TOMB = P + "api:{s}:x:1a2b3c"
W = P + "win:{s}"
L10b5 = {"rate": 10, "period_ms": 1000, "burst": 5}   # I = 100000, tau = 500000
L10b2 = {"rate": 10, "period_ms": 1000, "burst": 2}   # I = 100000, tau = 200000
L20m4 = {"rate": 20, "period_ms": 60000, "burst": 4}  # I = 3000000, tau = 12000000
L60m4 = {"rate": 60, "period_ms": 60000, "burst": 4} # I = 1000000, tau = 4000000
L3b0 = {"rate": 3, "period_ms": 1000, "burst": 0}     # I = ceil(1e6/3) = 333334, tau = 0
s = lambda v: str(v)
V = []

# book1 takes ARGV "" (or now), n*I, tau + I, W (docs/PROTOCOL.md, book1.lua:
# what its decision needs, worked out by the client). Each call below gives
# n*I and tau + I as worked out by hand from the limit (L10b5: I = 100000,
# tau + I = 600000), then n and W; the waits in the notes are the
# definition's, max(0, tat + (n-1)*I - tau - now), which the script reads as
# tat + n*I - (tau + I) - now. The hand-worked outcome is given as [now,
# booked (1/0), wait, tat judged against]; book1() lays it out as the
# script's reply string ("s u", then " tat" unless tat = now, "-" before it
# if refused; under an explicit now s is "0" and u is now) and as 'expect',
# what the engine makes of it.
def book1(name, note, before, limit, nI, tauI, n, w, outcome, after, now=N, error=None):
    v = {"name": name, "script": "book1", "note": note, "now": now,
         "input": {"prefix": P, "keys": ["api:{s}"], "limits": [limit], "requests": [{"n": n, "max_wait_us": w}]},
         "keys": [K1], "argv": [s(now), s(nI), s(tauI), s(w)], "before": before}
    if error: v["error"] = error
    else:
        at, ok, wait, tat = outcome
        assert at == now
        word = ("" if ok else "-") + ("" if tat == now else s(tat))
        v["reply"] = "0 %d" % now + (" " + word if word else "")
        v["expect"] = {"booked": bool(ok), "wait_us": wait, "tat": tat}
    v["after"] = after
    V.append(v)

book1("idle key: books at once", "tat = now; wait = max(0, now + 0*I - tau - now) = 0 <= 0; store now + I",
      {}, L10b5, 100000, 600000, 1, 0, [N, 1, 0, N], {K1: {"value": s(T(100000)), "px": 101}})
book1("sixth request after idle passes at once (burst 5: 6 back to back)",
      "stored now+5I: wait = max(0, now+500000 - 500000 - now) = 0; store now+600000",
      {K1: {"value": s(T(500000)), "px": 501}}, L10b5, 100000, 600000, 1, 0,
      [N, 1, 0, T(500000)], {K1: {"value": s(T(600000)), "px": 601}})
book1("seventh is refused with the exact retry-after; nothing written",
      "stored now+6I: wait = now+600000 - 500000 - now = 100000 > 0: refuse",
      {K1: {"value": s(T(600000)), "px": 601}}, L10b5, 100000, 600000, 1, 0,
      [N, 0, 100000, T(600000)], {K1: {"value": s(T(600000))}})
book1("seventh with max wait 100 ms books the slot 100 ms ahead",
      "wait 100000 <= 100000: store tat + I = now+700000",
      {K1: {"value": s(T(600000)), "px": 601}}, L10b5, 100000, 600000, 1, 100000,
      [N, 1, 100000, T(600000)], {K1: {"value": s(T(700000)), "px": 701}})
book1("max wait one microsecond short refuses",
      "wait 100000 > 99999: refuse, write nothing",
      {K1: {"value": s(T(600000)), "px": 601}}, L10b5, 100000, 600000, 1, 99999,
      [N, 0, 100000, T(600000)], {K1: {"value": s(T(600000))}})
# n*I = 3*100000 = 300000, tau + I = 600000
book1("three units on an idle key",
      "wait = max(0, now + 2*I - tau - now) = 0; store now + 3*I",
      {}, L10b5, 300000, 600000, 3, 0, [N, 1, 0, N], {K1: {"value": s(T(300000)), "px": 301}})
# n*I = 6*100000 = 600000, tau + I = 600000
book1("burst+1 units need the whole tolerance",
      "stored now+I, n = 6: wait = now+100000 + 5*100000 - 500000 - now = 100000 > 0: refuse",
      {K1: {"value": s(T(100000)), "px": 101}}, L10b5, 600000, 600000, 6, 0,
      [N, 0, 100000, T(100000)], {K1: {"value": s(T(100000))}})
book1("a stored TAT in the past counts as now",
      "tat = max(now-5s, now) = now; the reply carries now, not the stored value",
      {K1: {"value": s(T(-5000000)), "px": 3600000}}, L10b5, 100000, 600000, 1, 0,
      [N, 1, 0, N], {K1: {"value": s(T(100000)), "px": 101}})
# L3b0: n*I = 333334, tau + I = 0 + 333334
book1("interval rounded up to a microsecond, PX rounded up plus 1 ms",
      "3 per second: I = ceil(1000000/3) = 333334; store now+333334; PX = ceil(333334/1000)+1 = 335",
      {}, L3b0, 333334, 333334, 1, 0, [N, 1, 0, N], {K1: {"value": s(T(333334)), "px": 335}})
for val, why in [("abc", "not digits"), ("1e30", "not digits only"), ("-5", "a sign"),
                 ("10000000000000000", "17 characters"), ("9999999999999999", "more than 2^53")]:
    book1("corrupt value %s is an error naming the key" % json.dumps(val),
          "%s: SLOTBOOK_CORRUPT, nothing written" % why,
          {K1: {"value": val, "px": 3600000}}, L10b5, 100000, 600000, 1, 0, None,
          {K1: {"value": val}}, error="SLOTBOOK_CORRUPT key %s holds %s, not a TAT" % (K1, json.dumps(val)))
# The corruption bound is H + 2*(tau + I) ahead (PROTOCOL.md, Stored values;
# book1.lua reads it as H + 2 * reach): here H + 2*600000 = H + 1200000.
book1("a TAT beyond horizon + 2*(tau + I) is an error",
      "H + 2*(500000 + 100000) + 1 ahead: no booking under this limit reaches there",
      {K1: {"value": s(T(H + 1200001)), "px": 3600000}}, L10b5, 100000, 600000, 1, 0, None,
      {K1: {"value": s(T(H + 1200001))}},
      error="SLOTBOOK_CORRUPT key %s holds a TAT %d microseconds ahead" % (K1, H + 1200001))
book1("a TAT exactly horizon + 2*(tau + I) ahead is accepted (and refused)",
      "wait = H + 1200000 - tau = H + 700000 > 0: refuse",
      {K1: {"value": s(T(H + 1200000)), "px": 3600000}}, L10b5, 100000, 600000, 1, 0,
      [N, 0, H + 700000, T(H + 1200000)], {K1: {"value": s(T(H + 1200000))}})

# book's hand-worked outcome is given per request as (booked 1/0, wait,
# the m TATs it is judged against) after now: [now, ok_1, w_1, tats_1...,
# ok_2, ...]. book() lays out the requests as the runs of like ones the
# script takes (count, n, max wait), the reply (now, the first request's
# TATs, then how many of each run were booked), 'outcomes' (each
# request's booked and wait) and 'judged'.
def book(name, note, before, keys, limits, params, reqs, outcome, after, now=N):
    m = len(keys)
    runs = []
    for r in reqs:
        if runs and runs[-1][1:] == list(r): runs[-1][0] += 1
        else: runs.append([1, r[0], r[1]])
    argv = [s(now), s(m)] + [s(x) for p in params for x in p] + [s(x) for r in runs for x in r]
    assert outcome[0] == now
    per = [outcome[1 + i * (2 + m): 1 + (i + 1) * (2 + m)] for i in range(len(reqs))]
    booked, i = [], 0
    for count, _, _ in runs:
        oks = [ok for ok, *_ in per[i:i + count]]
        assert oks == sorted(oks, reverse=True), "a run's bookings are its first requests"
        booked.append(sum(oks))
        i += count
    reply = [now] + per[0][2:] + booked
    V.append({"name": name, "script": "book", "note": note, "now": now,
              "input": {"prefix": P, "keys": [k[len(P):] for k in keys], "limits": limits,
                        "requests": [{"n": n, "max_wait_us": w} for n, w in reqs]},
              "keys": keys, "argv": argv, "before": before, "reply": reply, "after": after,
              "outcomes": [{"booked": bool(ok), "wait_us": w} for ok, w, *_ in per],
              "judged": [x[2:] for x in per]})

book("batch on one key: each request judged in order",
     "stored now+4I. r1: wait 0, tat now+5I. r2: wait 0, tat now+6I. r3: wait 100000 > 0 refused. "
     "r4 (n=2, W=200000): wait now+6I + I - tau - now = 200000, booked, tat = now+6I + 2I",
     {K1: {"value": s(T(400000)), "px": 401}}, [K1], [L10b5], [(100000, 500000)],
     [(1, 0), (1, 0), (1, 0), (2, 200000)],
     [N, 1, 0, T(400000), 1, 0, T(500000), 0, 100000, T(600000), 1, 200000, T(600000)],
     {K1: {"value": s(T(800000)), "px": 801}})
book("batch with every request refused writes nothing",
     "stored now+6I: both wait 100000, more than 0 and 50000",
     {K1: {"value": s(T(600000)), "px": 601}}, [K1], [L10b5], [(100000, 500000)],
     [(1, 0), (1, 50000)], [N, 0, 100000, T(600000), 0, 100000, T(600000)],
     {K1: {"value": s(T(600000))}})
book("a run of eight alike on an idle key: the burst at once, then one an interval on",
     "tat = now; waits max(0, now + j*I - tau - now) = 0 for j = 0..5, then 100000 <= 150000: booked; "
     "j = 7: 200000 > 150000, refused; tat = now + 7I",
     {}, [K1], [L10b5], [(100000, 500000)], [(1, 150000)] * 8,
     [N] + [x for j in range(7) for x in (1, max(0, j * 100000 - 500000), T(j * 100000))] + [0, 200000, T(700000)],
     {K1: {"value": s(T(700000)), "px": 701}})
book("two limits: the per-minute one binds",
     "at1 = now+200000 - 200000 = now; at2 = now+15s - 12s = now+3s; slot now+3s, wait 3s <= 5s: booked; "
     "tat1 = max(now+0.2s, now+3s) + 0.1s = now+3.1s; tat2 = now+15s + 3s = now+18s. "
     "r2: at1 = now+2.9s, at2 = now+6s: wait 6s > 0, refused; it reports the TATs it was judged against",
     {K1: {"value": s(T(200000)), "px": 201}, K2: {"value": s(T(15000000)), "px": 15001}},
     [K1, K2], [L10b2, L20m4], [(100000, 200000), (3000000, 12000000)], [(1, 5000000), (1, 0)],
     [N, 1, 3000000, T(200000), T(15000000), 0, 6000000, T(3100000), T(18000000)],
     {K1: {"value": s(T(3100000)), "px": 3101}, K2: {"value": s(T(18000000)), "px": 18001}})
book("two limits: a refusal writes nothing in either",
     "as above with max wait 1s: wait 3s > 1s",
     {K1: {"value": s(T(200000)), "px": 201}, K2: {"value": s(T(15000000)), "px": 15001}},
     [K1, K2], [L10b2, L20m4], [(100000, 200000), (3000000, 12000000)], [(1, 1000000), (1, 0)],
     [N, 0, 3000000, T(200000), T(15000000), 0, 3000000, T(200000), T(15000000)],
     {K1: {"value": s(T(200000))}, K2: {"value": s(T(15000000))}})
book("two limits, idle: burst+1 of the tighter one at once",
     "n = 3: at1 = now + 2I1 - tau1 = now; at2 = now + 2I2 - tau2 < now; wait 0; tat1 = now+3I1, tat2 = now+3I2",
     {}, [K1, K2], [L10b2, L20m4], [(100000, 200000), (3000000, 12000000)], [(3, 0)],
     [N, 1, 0, N, N], {K1: {"value": s(T(300000)), "px": 301}, K2: {"value": s(T(9000000)), "px": 9001}})

def refund(name, note, now, before, keys, limits, booking, slot, pairs, reply, after):
    argv = [s(now), s(slot)] + [s(x) for p in pairs for x in p]
    V.append({"name": name, "script": "refund", "note": note, "now": now,
              "input": {"prefix": P, "keys": [k[len(P):] for k in keys[:-1]], "limits": limits, "booking": booking},
              "keys": keys, "argv": argv, "before": before, "reply": reply, "after": after})

bk1 = {"now": N, "n": 1, "wait_us": 100000, "tat_before": [T(600000)], "tat_after": [T(700000)], "id": "1a2b3c"}
bk1u = dict(bk1, unused=True)
refund("the latest booking comes back in full",
       "booked at now: wait 100 ms, tat now+0.6s -> now+0.7s. At now+10ms the key still holds now+0.7s: "
       "back to now+0.6s, 100000 given; tombstone until the slot (PX ceil(90000/1000)+1), recording what was given "
       "back (\"1 100000\"); no tombstone found: earlier_1 = 0",
       T(10000), {K1: {"value": s(T(700000)), "px": 701}}, [K1, TOMB], [L10b5], bk1, T(100000),
       [(T(600000), T(700000))], [T(10000), 100000, 0],
       {K1: {"value": s(T(600000)), "px": 591}, TOMB: {"value": "1 100000", "px": 91}})
refund("a retried refund gives nothing, even where the key again ends where the booking did, and reports what the first gave",
       "tombstone present, left by a first refund that gave 100000 (its reply lost, say): nothing given, nothing "
       "written; earlier_1 = 100000, read from the tombstone",
       T(10000), {K1: {"value": s(T(700000)), "px": 701}, TOMB: {"value": "1 100000", "px": 91}}, [K1, TOMB], [L10b5], bk1,
       T(100000), [(T(600000), T(700000))], [T(10000), 0, 100000],
       {K1: {"value": s(T(700000))}, TOMB: {"value": "1 100000"}})
refund("a refund that finds a tombstone of \"1\" alone gives nothing and reports nothing given before",
       "tombstone present as a refund that gave nothing, or a version 1 client, leaves it: nothing given, nothing "
       "written; earlier_1 = 0",
       T(10000), {K1: {"value": s(T(700000)), "px": 701}, TOMB: {"value": "1", "px": 91}}, [K1, TOMB], [L10b5], bk1,
       T(100000), [(T(600000), T(700000))], [T(10000), 0, 0],
       {K1: {"value": s(T(700000))}, TOMB: {"value": "1"}})
refund("a booking that a later one stands on gives nothing, and leaves its tombstone",
       "the key holds now+0.8s, not the booking's end now+0.7s",
       T(10000), {K1: {"value": s(T(800000)), "px": 801}}, [K1, TOMB], [L10b5], bk1, T(100000),
       [(T(600000), T(700000))], [T(10000), 0, 0],
       {K1: {"value": s(T(800000))}, TOMB: {"value": "1", "px": 91}})
refund("a booking made before a pause gives nothing",
       "a 2 s pause at now moved the key to now + 2s + tau = now+2.5s, off the booking's end",
       T(10000), {K1: {"value": s(T(2500000)), "px": 2501}}, [K1, TOMB], [L10b5], bk1, T(100000),
       [(T(600000), T(700000))], [T(10000), 0, 0],
       {K1: {"value": s(T(2500000))}, TOMB: {"value": "1", "px": 91}})
refund("a slot that has come gives nothing and writes nothing",
       "now = slot: not live, no tombstone",
       T(100000), {K1: {"value": s(T(700000)), "px": 701}}, [K1, TOMB], [L10b5], bk1, T(100000),
       [(T(600000), T(700000))], [T(100000), 0, 0], {K1: {"value": s(T(700000))}, TOMB: None})
refund("two limits: each goes back; one whose earlier TAT has passed is deleted",
       "the 'per-minute binds' booking (slot now+3s; tat1 now+0.2s -> now+3.1s, tat2 now+15s -> now+18s), "
       "refunded at now+1s: key 1 gives 3.1s - max(0.2s, 1s) = 2.1s and, its earlier TAT passed, is deleted; "
       "key 2 gives 3s and goes back to now+15s (PX ceil(14000000/1000)+1); tombstone PX ceil(2000000/1000)+1, "
       "recording both (\"1 2100000 3000000\")",
       T(1000000), {K1: {"value": s(T(3100000)), "px": 3101}, K2: {"value": s(T(18000000)), "px": 18001}},
       [K1, K2, TOMB], [L10b2, L20m4],
       {"now": N, "n": 1, "wait_us": 3000000, "tat_before": [T(200000), T(15000000)],
        "tat_after": [T(3100000), T(18000000)], "id": "1a2b3c"},
       T(3000000), [(T(200000), T(3100000)), (T(15000000), T(18000000))], [T(1000000), 2100000, 3000000, 0, 0],
       {K1: None, K2: {"value": s(T(15000000)), "px": 14001}, TOMB: {"value": "1 2100000 3000000", "px": 2001}})
refund("unused: a booking no one acted on comes back after its slot, as far as it stands",
       "the client sends the latest end (now+0.7s) for the slot: at now+0.2s, past the slot (now+0.1s), the key "
       "still holds now+0.7s: back to now+0.6s, 100000 given; tombstone until now+0.7s (PX ceil(500000/1000)+1), "
       "\"1 100000\"",
       T(200000), {K1: {"value": s(T(700000)), "px": 501}}, [K1, TOMB], [L10b5], bk1u, T(700000),
       [(T(600000), T(700000))], [T(200000), 100000, 0],
       {K1: {"value": s(T(600000)), "px": 401}, TOMB: {"value": "1 100000", "px": 501}})
refund("two limits: a key whose end has passed gives nothing and is not written",
       "an unused booking (slot now; tat1 now -> now+0.1s, tat2 now -> now+1s under 60/min, I = 1s) refunded at now+0.5s with the latest "
       "end now+1s: key 1's end has passed (it gives 0, not -0.4s); key 2 gives 0.5s and is deleted (its earlier TAT "
       "passed); tombstone until now+1s, \"1 0 500000\"",
       T(500000), {K1: {"value": s(T(100000)), "px": 60000}, K2: {"value": s(T(1000000)), "px": 501}},
       [K1, K2, TOMB], [L10b2, L60m4],
       {"now": N, "n": 1, "wait_us": 0, "tat_before": [N, N], "tat_after": [T(100000), T(1000000)], "id": "1a2b3c", "unused": True},
       T(1000000), [(N, T(100000)), (N, T(1000000))], [T(500000), 0, 500000, 0, 0],
       {K1: {"value": s(T(100000))}, K2: None, TOMB: {"value": "1 0 500000", "px": 501}})

def block(name, note, before, keys, limits, d, params, reply, after, error=None):
    argv = [s(N), s(d)] + [s(x) for p in params for x in p]
    v = {"name": name, "script": "block", "note": note, "now": N,
         "input": {"prefix": P, "keys": ["api:{s}", "api:{s}:60000ms"][:len(limits)], "limits": limits, "pause_us": d},
         "keys": keys, "argv": argv, "before": before}
    if error: v["error"] = error
    else: v["reply"] = reply
    v["after"] = after
    V.append(v)

block("pause an idle key for 2 s", "target = now + 2s + tau = now+2.5s: the first slot, tat - tau, is now+2s",
      {}, [K1], [L10b5], 2000000, [(100000, 500000)], [N, T(2500000)], {K1: {"value": s(T(2500000)), "px": 2501}})
block("pause a key already held beyond its end: it still moves by 1 us",
      "old now+3s >= target now+2.5s: tat = old + 1; PX = ceil(3000001/1000)+1 = 3002",
      {K1: {"value": s(T(3000000)), "px": 3001}}, [K1], [L10b5], 2000000, [(100000, 500000)],
      [N, T(3000001)], {K1: {"value": s(T(3000001)), "px": 3002}})
block("pause a key that holds exactly the target", "old = target: tat = target + 1",
      {K1: {"value": s(T(2500000)), "px": 2501}}, [K1], [L10b5], 2000000, [(100000, 500000)],
      [N, T(2500001)], {K1: {"value": s(T(2500001)), "px": 2502}})
block("pause of 0: the burst is spent, requests go one interval apart from now",
      "target = now + tau", {}, [K1], [L10b5], 0, [(100000, 500000)], [N, T(500000)],
      {K1: {"value": s(T(500000)), "px": 501}})
block("two limits: only the one with the shortest interval is pushed",
      "10/s burst 2 and 20/min burst 4: KEYS and ARGV carry the 10/s key only; target = now + 1s + 0.2s",
      {K2: {"value": s(T(15000000)), "px": 15001}}, [K1], [L10b2, L20m4], 1000000, [(100000, 200000)],
      [N, T(1200000)], {K1: {"value": s(T(1200000)), "px": 1201}, K2: {"value": s(T(15000000))}})
block("pause over a corrupt value is an error", "the value is checked as bookings check it",
      {K1: {"value": "abc", "px": 3600000}}, [K1], [L10b5], 2000000, [(100000, 500000)], None,
      {K1: {"value": "abc"}}, error='SLOTBOOK_CORRUPT key %s holds "abc", not a TAT' % K1)

book1("after a 2 s pause the first request waits 2 s",
      "stored now+2.5s: wait = now+2.5s - tau - now = 2s",
      {K1: {"value": s(T(2500000)), "px": 2501}}, L10b5, 100000, 600000, 1, H,
      [N, 1, 2000000, T(2500000)], {K1: {"value": s(T(2600000)), "px": 2601}})
book1("and the next one an interval later, not in a burst",
      "stored now+2.6s: wait = 2.1s",
      {K1: {"value": s(T(2600000)), "px": 2601}}, L10b5, 100000, 600000, 1, H,
      [N, 1, 2100000, T(2600000)], {K1: {"value": s(T(2700000)), "px": 2701}})

def reset(name, note, before, keys, reply, after):
    V.append({"name": name, "script": "reset", "note": note, "now": N,
              "input": {"prefix": P, "keys": [k[len(P):] for k in keys]},
              "keys": keys, "argv": [], "before": before, "reply": reply, "after": after})
KD = P + "api:{s}:86400000ms"
reset("reset deletes every key of the subject", "DEL of both keys: 2",
      {K1: {"value": s(T(300000)), "px": 301}, KD: {"value": s(T(9000000)), "px": 9001}}, [K1, KD], 2,
      {K1: None, KD: None})
reset("reset of a subject with one key already gone", "DEL: 1", {K1: {"value": s(T(300000)), "px": 301}},
      [K1, KD], 1, {K1: None, KD: None})

def window(name, note, before, mx, span, n, reply, after):
    V.append({"name": name, "script": "window", "note": note, "now": N,
              "input": {"prefix": P, "keys": ["win:{s}"], "window": {"max": mx, "span_us": span}, "n": n},
              "keys": [W], "argv": [s(N), s(span), s(mx), s(n)], "before": before, "reply": reply, "after": after})
window("window: first event", "empty: 0 + 1 <= 3; member '<now>-1'; PEXPIRE ceil(span/1000)+1",
       {}, 3, 1000000, 1, [1, 0, 2, 1000000], {W: {"zset": {"%d-1" % N: N}, "px": 1001}})
window("window: full, denied until the oldest leaves",
       "3 events in (now-1s, now]: need 1 to leave; the oldest (now-0.9s) leaves at now+0.1s; newest at now+0.9s",
       {W: {"zset": {"a": T(-900000), "b": T(-500000), "c": T(-100000)}, "px": 1001}}, 3, 1000000, 1,
       [0, 100000, 0, 900000], {W: {"zset": {"a": T(-900000), "b": T(-500000), "c": T(-100000)}}})
window("window: an event exactly one span old has left",
       "the window is (now - span, now]: 'a' at now-1s is removed; 1 + 2 <= 3; members '<now>-2', '<now>-3'",
       {W: {"zset": {"a": T(-1000000), "b": T(-500000)}, "px": 1001}}, 3, 1000000, 2,
       [1, 0, 0, 1000000], {W: {"zset": {"b": T(-500000), "%d-2" % N: N, "%d-3" % N: N}, "px": 1001}})
window("window: two wanted, the second oldest must leave",
       "count 3, need 2: the 2nd oldest (now-0.5s) leaves at now+0.5s",
       {W: {"zset": {"a": T(-900000), "b": T(-500000), "c": T(-100000)}, "px": 1001}}, 3, 1000000, 2,
       [0, 500000, 0, 900000], {W: {"zset": {"a": T(-900000), "b": T(-500000), "c": T(-100000)}}})

doc = {
    "protocol": 2,
    "spec": "docs/PROTOCOL.md",
    "about": ("Test vectors of the slotbook wire protocol. Each vector is one script call at an explicit now "
              "(ARGV[1], microseconds): set the keys in 'before' (a string 'value' or a sorted set 'zset' of "
              "member: score, with 'px' as its time to live in ms), run the script (clock.lua followed by the "
              "script's file; book1.lua and reset.lua alone) with 'keys' and 'argv', and compare the reply (or the error, "
              "whose text starts with 'error') and the keys in 'after'. In 'after', null means the key does not "
              "exist; a key with 'px' was written with that time to live, a key without it was not written by "
              "the call. 'px' is what the scripts set on the Redis clock (ARGV[1] = \"\"); under an explicit now "
              "they add explicit_now_hold_ms, so that Redis's own clock never expires a key the explicit "
              "clock has not passed. For book, 'outcomes' lists what a client makes of the reply for each "
              "request (booked or refused, and the wait) and 'judged' the TATs each request is judged against "
              "(the reply carries the first request's and how many of each run were booked; a client works out "
              "the rest). book1 answers one string "
              "(docs/PROTOCOL.md); its 'expect' is what a client makes of it: booked or refused, the wait, and "
              "the TAT the request was judged against. 'input' is the same call in the library's terms (limits as rate per "
              "period_ms with burst; times in microseconds). Expected values were worked out by hand from the "
              "definition, each vector's 'note' says how."),
    "explicit_now_hold_ms": 3600000,
    "horizon_us": H,
    "vectors": V,
}
print(json.dumps(doc, indent=1))
