package metrics_test

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/slotbook/slotbook/metrics"
)

// collector is metrics.New for tests: an error fails the test.
func collector(t *testing.T, opts ...metrics.Option) *metrics.Collector {
	t.Helper()
	m, err := metrics.New(opts...)
	require.NoError(t, err)
	return m
}

// TestBadOptions: a bad option is an error from New, as in every package
// of the module, not a panic or a registration failure later.
func TestBadOptions(t *testing.T) {
	t.Parallel()
	for name, opt := range map[string]metrics.Option{
		"namespace with a dash":  metrics.WithNamespace("my-app"),
		"namespace with a digit": metrics.WithNamespace("9lives"),
		"label name with a dot":  metrics.WithConstLabels(prometheus.Labels{"app.name": "x"}),
		"reserved label name":    metrics.WithConstLabels(prometheus.Labels{"__name": "x"}),
		"empty label name":       metrics.WithConstLabels(prometheus.Labels{"": "x"}),
		"the limiter label":      metrics.WithConstLabels(prometheus.Labels{"limiter": "x"}),
		"the bucket label":       metrics.WithConstLabels(prometheus.Labels{"le": "x"}),
		"value not UTF-8":        metrics.WithConstLabels(prometheus.Labels{"app": "\xff"}),
	} {
		m, err := metrics.New(opt)
		require.Error(t, err, name)
		require.Nil(t, m, name)
		require.True(t, strings.HasPrefix(err.Error(), "metrics: "), err.Error())
	}
	// Good ones register.
	for _, opts := range [][]metrics.Option{
		nil,
		{metrics.WithNamespace("")},
		{metrics.WithNamespace("acme:edge_1"), metrics.WithConstLabels(prometheus.Labels{"app": "billing", "_x": "é"})},
	} {
		require.NoError(t, prometheus.NewPedanticRegistry().Register(collector(t, opts...)))
	}
}
