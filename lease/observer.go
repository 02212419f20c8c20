package lease

import (
	"context"
	"errors"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// An Observer is told of a Semaphore's work. Its methods are called
// synchronously, some with the Semaphore's lock held, from many goroutines
// at once: they must be quick, safe for concurrent use, and must not call
// the Semaphore. name is the Semaphore's name (never a key).
type Observer interface {
	// ObserveHeld reports a change (+1, -1) in the leases this process
	// holds.
	ObserveHeld(name string, delta int)
	// ObserveWaiting reports a change (+1, -1) in the callers of this
	// process waiting for a lease: Acquire callers, and TryAcquire callers
	// for the length of their call.
	ObserveWaiting(name string, delta int)
	// ObserveWait reports how long an Acquire or TryAcquire took, and its
	// error (nil: a lease was granted, or TryAcquire found none free).
	ObserveWait(name string, d time.Duration, err error)
	// ObserveExpired reports leases found lapsed and dropped from Redis
	// by this process's calls: their holder, in any process, stopped
	// extending them (it died, or stalled for longer than the TTL). Each
	// lapsed lease is counted once, by whichever process swept it.
	ObserveExpired(name string, n int)
}

type nopObserver struct{}

func (nopObserver) ObserveHeld(string, int)                  {}
func (nopObserver) ObserveWaiting(string, int)               {}
func (nopObserver) ObserveWait(string, time.Duration, error) {}
func (nopObserver) ObserveExpired(string, int)               {}

// A Collector is an Observer that keeps Prometheus metrics, labelled by
// the semaphore's name:
//
//	slotbook_lease_held{name}                   gauge: leases this process holds
//	slotbook_lease_waiters{name}                gauge: callers of this process waiting
//	slotbook_lease_wait_seconds{name,outcome}   histogram: time to a lease (outcome acquired, cancelled, error)
//	slotbook_lease_expired_total{name}          counter: leases dropped because their holder stopped extending them
//
// Register it with a prometheus.Registerer and pass it to WithObserver;
// one Collector may serve many Semaphores. It is safe for concurrent use.
type Collector struct {
	held    *prometheus.GaugeVec
	waiters *prometheus.GaugeVec
	wait    *prometheus.HistogramVec
	expired *prometheus.CounterVec
}

// NewCollector returns a Collector; nothing is registered.
func NewCollector() *Collector {
	return &Collector{
		held: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "slotbook_lease_held", Help: "Leases this process holds.",
		}, []string{"name"}),
		waiters: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "slotbook_lease_waiters", Help: "Callers of this process waiting for a lease.",
		}, []string{"name"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "slotbook_lease_wait_seconds", Help: "Time from Acquire to its lease (or its end).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10),
		}, []string{"name", "outcome"}),
		expired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "slotbook_lease_expired_total", Help: "Leases dropped because their holder stopped extending them.",
		}, []string{"name"}),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	c.held.Describe(ch)
	c.waiters.Describe(ch)
	c.wait.Describe(ch)
	c.expired.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	c.held.Collect(ch)
	c.waiters.Collect(ch)
	c.wait.Collect(ch)
	c.expired.Collect(ch)
}

// ObserveHeld implements Observer.
func (c *Collector) ObserveHeld(name string, delta int) {
	c.held.WithLabelValues(name).Add(float64(delta))
}

// ObserveWaiting implements Observer.
func (c *Collector) ObserveWaiting(name string, delta int) {
	c.waiters.WithLabelValues(name).Add(float64(delta))
}

// ObserveWait implements Observer.
func (c *Collector) ObserveWait(name string, d time.Duration, err error) {
	outcome := "acquired"
	switch {
	case err == nil:
	case errors.Is(err, ErrClosed) || isContext(err):
		outcome = "cancelled"
	default:
		outcome = "error"
	}
	c.wait.WithLabelValues(name, outcome).Observe(d.Seconds())
}

// ObserveExpired implements Observer.
func (c *Collector) ObserveExpired(name string, n int) {
	c.expired.WithLabelValues(name).Add(float64(n))
}

func isContext(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}
