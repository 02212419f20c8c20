// Package metrics exposes slotbook's work as Prometheus metrics: a
// Collector that is also the engine's throttle.Observer. Nothing is
// registered for you:
//
//	m, err := metrics.New()                         // a bad option is an error
//	prometheus.MustRegister(m)                      // or your own registry
//	eng, err := throttle.New(rdb, throttle.WithObserver(m))
//
// Every metric is labelled by limiter name, never by subject key, and the
// breaker gauge by Redis node, so the number of series stays bounded:
//
//	slotbook_decisions_total{limiter,outcome}        requests by outcome: allowed, denied, booked,
//	                                                 refused, fallback_allowed, fallback_refused
//	slotbook_booked_wait_seconds{limiter}            histogram of booked waits: the queue in front of the limit
//	                                                 (reservations booked, and those the fallback admitted;
//	                                                 never check-mode requests, which book nothing)
//	slotbook_redis_call_duration_seconds{limiter}    histogram of script calls to Redis
//	slotbook_redis_errors_total{limiter}             script calls that failed
//	slotbook_lost_replies_total{limiter}             script calls sent whose reply never came: a booking
//	                                                 call's may have booked slots nobody will use (quota
//	                                                 wasted), a refund's may have given time back
//	slotbook_refunds_total{limiter}                  refunds that gave time back (one whose reply was lost
//	                                                 is counted, once, when it is retried before its slot)
//	slotbook_refunds_noop_total{limiter}             refunds that gave nothing back: a later booking or a
//	                                                 pause stood on the booking (any refund); its slot had
//	                                                 come (the engine's Refund called directly: reserve's
//	                                                 Cancel makes no call then), or, for a booking no one
//	                                                 used (given back as unused, as reserve does for late
//	                                                 refusals), its units no longer stood; or it was given
//	                                                 back before (the engine's Refund called again, or a
//	                                                 retry of a lost refund that gave nothing; reserve's
//	                                                 second Cancel makes no call)
//	slotbook_refunded_seconds_total{limiter}         time given back by refunds
//	slotbook_breaker_open{node}                      breakers open for the Redis node (its address; the
//	                                                 master of a Cluster): while open, calls for subjects
//	                                                 on that node fail fast or the fallback answers
//
// A call that books for several limiters at once (a merged call, see
// throttle.WithMerging) counts once for each of them in the call metrics.
//
// One Collector serves any number of engines: give it to each with
// throttle.WithObserver. The breaker gauge counts each engine's breaker for
// a node (0 or 1 with one engine per Redis), so one engine's outage never
// shows on another's node. Per limiter, the fallback's share is
// rate(slotbook_decisions_total{outcome=~"fallback_.*"}). Two Collectors in
// one registry must differ in WithNamespace, or have WithConstLabels with
// the same label names and different values (for instance
// {"engine": "orders"} and {"engine": "payments"}): the registry refuses
// two collectors of the same metrics, and metrics of one name with
// different label names.
package metrics

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/slotbook/slotbook/throttle"
)

// Collector gathers slotbook's metrics. It is a prometheus.Collector and a
// throttle.Observer, safe for concurrent use. Build it with New.
type Collector struct {
	decisions     *prometheus.CounterVec
	bookedWait    *prometheus.HistogramVec
	callDuration  *prometheus.HistogramVec
	callErrors    *prometheus.CounterVec
	lostReplies   *prometheus.CounterVec
	refunds       *prometheus.CounterVec
	refundsNoop   *prometheus.CounterVec
	refundSeconds *prometheus.CounterVec
	breakerOpen   *prometheus.GaugeVec
}

// An Option configures a Collector in New.
type Option func(*options) error

type options struct {
	namespace   string
	constLabels prometheus.Labels
}

// WithNamespace replaces the "slotbook" prefix of the metric names: ns
// must be empty (no prefix) or a valid metric name ([a-zA-Z_:][a-zA-Z0-9_:]*).
func WithNamespace(ns string) Option {
	return func(o *options) error {
		if ns != "" && !validName(ns, true) {
			return fmt.Errorf("metrics: namespace %q is not a valid metric name", ns)
		}
		o.namespace = ns
		return nil
	}
}

// WithConstLabels adds labels to every metric (an application name, say).
// Their names must be valid label names, not reserved ("__" first) and not
// one of the Collector's own labels; their values valid UTF-8.
func WithConstLabels(l prometheus.Labels) Option {
	return func(o *options) error {
		for name, v := range l {
			switch {
			case !validName(name, false) || strings.HasPrefix(name, "__"):
				return fmt.Errorf("metrics: const label name %q is not a valid label name", name)
			case slices.Contains(ownLabels, name):
				return fmt.Errorf("metrics: const label %q is one of the collector's own labels %v", name, ownLabels)
			case !utf8.ValidString(v):
				return fmt.Errorf("metrics: const label %q: value is not valid UTF-8", name)
			}
		}
		o.constLabels = l
		return nil
	}
}

// ownLabels are the labels the Collector's metrics carry ("le": the
// histograms' buckets).
var ownLabels = []string{"limiter", "outcome", "node", "le"}

// validName reports whether s is a Prometheus metric name (colons allowed)
// or label name.
func validName(s string, colons bool) bool {
	for i, r := range s {
		ok := r == '_' || (r >= 'a' && r <= 'z') || (r >= 'A' && r <= 'Z') || (i > 0 && r >= '0' && r <= '9') || (colons && r == ':')
		if !ok {
			return false
		}
	}
	return s != ""
}

// New returns a Collector; register it with a prometheus.Registerer and pass
// it to throttle.WithObserver. A bad option is an error. New registers
// nothing.
func New(opts ...Option) (*Collector, error) {
	o := options{namespace: "slotbook"}
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			return nil, err
		}
	}
	lim := []string{"limiter"}
	return &Collector{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "decisions_total", ConstLabels: o.constLabels,
			Help: "Requests decided, by outcome.",
		}, []string{"limiter", "outcome"}),
		bookedWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: o.namespace, Name: "booked_wait_seconds", ConstLabels: o.constLabels,
			Help:    "Wait until the booked slot: the queue in front of the limit.",
			Buckets: []float64{0, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, lim),
		callDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: o.namespace, Name: "redis_call_duration_seconds", ConstLabels: o.constLabels,
			Help:    "Duration of script calls to Redis.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25},
		}, lim),
		callErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "redis_errors_total", ConstLabels: o.constLabels,
			Help: "Script calls to Redis that failed.",
		}, lim),
		lostReplies: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "lost_replies_total", ConstLabels: o.constLabels,
			Help: "Script calls sent to Redis whose reply never came: a booking call's may have booked slots nobody will use, a refund's may have given time back (counted in the refund metrics if the refund is retried).",
		}, lim),
		refunds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "refunds_total", ConstLabels: o.constLabels,
			Help: "Refunds that gave time back.",
		}, lim),
		refundsNoop: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "refunds_noop_total", ConstLabels: o.constLabels,
			Help: "Refunds that gave nothing back: a later booking or a pause stood on the booking (any refund); its slot had come (the engine's Refund called directly: reserve's Cancel makes no call then), or, for a booking no one used (given back as unused, as reserve does for late refusals), its units no longer stood; or it was given back before (the engine's Refund called again, or a retry of a lost refund that gave nothing).",
		}, lim),
		refundSeconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "refunded_seconds_total", ConstLabels: o.constLabels,
			Help: "Time given back by refunds.",
		}, lim),
		breakerOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: o.namespace, Name: "breaker_open", ConstLabels: o.constLabels,
			Help: "Engines whose breaker for the Redis node is open: calls for subjects on it fail fast or the fallback answers.",
		}, []string{"node"}),
	}, nil
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.all() {
		m.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c.all() {
		m.Collect(ch)
	}
}

func (c *Collector) all() []prometheus.Collector {
	return []prometheus.Collector{c.decisions, c.bookedWait, c.callDuration, c.callErrors, c.lostReplies, c.refunds, c.refundsNoop, c.refundSeconds, c.breakerOpen}
}

// ObserveDecision implements throttle.Observer.
func (c *Collector) ObserveDecision(limiter string, o throttle.Outcome, wait time.Duration) {
	c.decisions.WithLabelValues(limiter, o.String()).Inc()
	// A FallbackAllowed with a negative wait (throttle.NoWait) was a
	// check-mode request: it booked nothing.
	if (o == throttle.Booked || o == throttle.FallbackAllowed) && wait >= 0 {
		c.bookedWait.WithLabelValues(limiter).Observe(wait.Seconds())
	}
}

// ObserveCall implements throttle.Observer.
func (c *Collector) ObserveCall(limiter string, d time.Duration, err error) {
	c.callDuration.WithLabelValues(limiter).Observe(d.Seconds())
	if err != nil {
		c.callErrors.WithLabelValues(limiter).Inc()
		if errors.Is(err, throttle.ErrReplyLost) {
			c.lostReplies.WithLabelValues(limiter).Inc()
		}
	}
}

// ObserveRefund implements throttle.Observer: a refund that gave time
// back counts in refunds_total, one that gave nothing in
// refunds_noop_total.
func (c *Collector) ObserveRefund(limiter string, given time.Duration) {
	if given <= 0 {
		c.refundsNoop.WithLabelValues(limiter).Inc()
		return
	}
	c.refunds.WithLabelValues(limiter).Inc()
	c.refundSeconds.WithLabelValues(limiter).Add(given.Seconds())
}

// ObserveBreaker implements throttle.Observer. It does nothing: the
// Collector follows each node's breaker through ObserveNodeBreaker, which
// tells which Redis node, and so which engine's, changed.
func (c *Collector) ObserveBreaker(bool) {}

// ObserveNodeBreaker implements throttle.NodeObserver: the node's gauge
// counts the engines whose breaker for it is open. The engine reports each
// node's changes in order, alternating, starting with an opening.
func (c *Collector) ObserveNodeBreaker(node string, open bool) {
	if open {
		c.breakerOpen.WithLabelValues(node).Inc()
	} else {
		c.breakerOpen.WithLabelValues(node).Dec()
	}
}

var _ throttle.NodeObserver = (*Collector)(nil)
