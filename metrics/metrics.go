// Package metrics exposes slotbook's work as Prometheus metrics: a
// Collector that is also the engine's throttle.Observer. Nothing is
// registered for you:
//
//	m := metrics.New()
//	prometheus.MustRegister(m)                      // or your own registry
//	eng, err := throttle.New(rdb, throttle.WithObserver(m))
//
// Every metric is labelled by limiter name, never by subject key, so the
// number of series stays bounded:
//
//	slotbook_decisions_total{limiter,outcome}        requests by outcome: allowed, denied, booked,
//	                                                 refused, fallback_allowed, fallback_refused
//	slotbook_booked_wait_seconds{limiter}            histogram of booked waits: the queue in front of the limit
//	slotbook_redis_call_duration_seconds{limiter}    histogram of script calls to Redis
//	slotbook_redis_errors_total{limiter}             script calls that failed
//	slotbook_lost_replies_total{limiter}             script calls sent whose reply never came: each may
//	                                                 have booked slots nobody will use (quota wasted)
//	slotbook_refunds_total{limiter}                  bookings given back
//	slotbook_refunded_seconds_total{limiter}         time given back by refunds
//	slotbook_fallback_active{limiter}                1 while Redis is unavailable and the fallback answers
package metrics

import (
	"errors"
	"sync"
	"time"

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
	refundSeconds *prometheus.CounterVec
	fallback      *prometheus.GaugeVec

	mu       sync.Mutex          // guards limiters and open
	limiters map[string]struct{} // names seen, for the fallback gauge
	open     bool
}

// An Option configures a Collector.
type Option func(*options)

type options struct {
	namespace   string
	constLabels prometheus.Labels
}

// WithNamespace replaces the "slotbook" prefix of the metric names.
func WithNamespace(ns string) Option { return func(o *options) { o.namespace = ns } }

// WithConstLabels adds labels to every metric (an application name, say).
func WithConstLabels(l prometheus.Labels) Option { return func(o *options) { o.constLabels = l } }

// New returns a Collector; register it with a prometheus.Registerer and pass
// it to throttle.WithObserver.
func New(opts ...Option) *Collector {
	o := options{namespace: "slotbook"}
	for _, opt := range opts {
		opt(&o)
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
			Help: "Script calls sent to Redis whose reply never came: each may have booked slots nobody will use.",
		}, lim),
		refunds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "refunds_total", ConstLabels: o.constLabels,
			Help: "Bookings given back.",
		}, lim),
		refundSeconds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: o.namespace, Name: "refunded_seconds_total", ConstLabels: o.constLabels,
			Help: "Time given back by refunds.",
		}, lim),
		fallback: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: o.namespace, Name: "fallback_active", ConstLabels: o.constLabels,
			Help: "1 while Redis is unavailable and the fallback policy answers.",
		}, lim),
		limiters: make(map[string]struct{}),
	}
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
	return []prometheus.Collector{c.decisions, c.bookedWait, c.callDuration, c.callErrors, c.lostReplies, c.refunds, c.refundSeconds, c.fallback}
}

// ObserveDecision implements throttle.Observer.
func (c *Collector) ObserveDecision(limiter string, o throttle.Outcome, wait time.Duration) {
	c.seen(limiter)
	c.decisions.WithLabelValues(limiter, o.String()).Inc()
	if o == throttle.Booked || o == throttle.FallbackAllowed {
		c.bookedWait.WithLabelValues(limiter).Observe(wait.Seconds())
	}
}

// ObserveCall implements throttle.Observer.
func (c *Collector) ObserveCall(limiter string, d time.Duration, err error) {
	c.seen(limiter)
	c.callDuration.WithLabelValues(limiter).Observe(d.Seconds())
	if err != nil {
		c.callErrors.WithLabelValues(limiter).Inc()
		if errors.Is(err, throttle.ErrReplyLost) {
			c.lostReplies.WithLabelValues(limiter).Inc()
		}
	}
}

// ObserveRefund implements throttle.Observer.
func (c *Collector) ObserveRefund(limiter string, given time.Duration) {
	c.refunds.WithLabelValues(limiter).Inc()
	c.refundSeconds.WithLabelValues(limiter).Add(given.Seconds())
}

// ObserveBreaker implements throttle.Observer: the fallback gauge of every
// limiter seen follows the engine's breaker.
func (c *Collector) ObserveBreaker(open bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open = open
	for name := range c.limiters {
		c.fallback.WithLabelValues(name).Set(b2f(open))
	}
}

func (c *Collector) seen(limiter string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.limiters[limiter]; ok {
		return
	}
	c.limiters[limiter] = struct{}{}
	c.fallback.WithLabelValues(limiter).Set(b2f(c.open))
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

var _ throttle.Observer = (*Collector)(nil)
